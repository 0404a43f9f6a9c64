# SPDX-License-Identifier: Apache-2.0
"""In-flight coalescing: one encode per content key, however many wait for it.

Pure bookkeeping, no tensors. A *flight* is one key being encoded; its
*waiters* are the ``(request_id, item_index)`` slots that want the result.
The first waiter opened the flight (its cache state is ``miss``); later ones
attached to it (``coalesced``). Invariant: a flight exists iff it has at least
one waiter, and a key has at most one flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

Slot = tuple[str, int]


@dataclass
class Flight:
    key: bytes
    payload: Any
    cost: int
    opener: Slot
    waiters: list[Slot] = field(default_factory=list)

    @property
    def unit_id(self) -> str:
        """The scheduler's id for this flight: one schedulable unit per key."""
        return self.key.hex()


class InflightTable:
    """Flights by key, plus the reverse index from requests to their flights."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, Flight] = {}
        self._by_request: dict[str, set[bytes]] = {}
        self.coalesced_total = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def get(self, key: bytes) -> Flight | None:
        return self._by_key.get(key)

    def open(self, key: bytes, payload: Any, cost: int, slot: Slot) -> Flight:
        if key in self._by_key:
            raise KeyError(f"flight {key.hex()} already open")
        flight = Flight(key, payload, cost, slot, [slot])
        self._by_key[key] = flight
        self._by_request.setdefault(slot[0], set()).add(key)
        return flight

    def attach(self, key: bytes, slot: Slot) -> Flight:
        flight = self._by_key[key]
        flight.waiters.append(slot)
        self._by_request.setdefault(slot[0], set()).add(key)
        self.coalesced_total += 1
        return flight

    def land(self, key: bytes) -> Flight:
        """Close the flight (its encode finished or failed) and return it."""
        flight = self._by_key.pop(key)
        for rid, _ in flight.waiters:
            keys = self._by_request.get(rid)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_request[rid]
        return flight

    def detach_request(self, request_id: str) -> Iterator[Flight]:
        """Remove every slot of a request; yield the flights left with no waiter.

        Those flights are closed: the caller must unschedule them.
        """
        for key in sorted(self._by_request.pop(request_id, ())):
            flight = self._by_key[key]
            flight.waiters = [s for s in flight.waiters if s[0] != request_id]
            if not flight.waiters:
                del self._by_key[key]
                yield flight
