# SPDX-License-Identifier: Apache-2.0
"""In-flight coalescing: one encode per content key, however many wait for it.

Pure bookkeeping, no tensors. A *flight* is one key being encoded; its
*waiters* are the ``(request_id, item_index)`` slots that want the result.
The first waiter opened the flight (its cache state is ``miss``); later ones
attached to it (``coalesced``). Invariant: a flight exists iff it has at least
one waiter, and a key has at most one flight.

A flight may be encoded in ``parts`` (a long video in chunks of whole temporal
groups): each part is its own scheduler unit, and the flight lands only when
every part has an output, reassembled in part order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from epd_encoder.types import ItemOutput

Slot = tuple[str, int]


@dataclass
class Flight:
    key: bytes
    payload: Any
    cost: int
    opener: Slot
    waiters: list[Slot] = field(default_factory=list)
    parts: tuple[tuple[Any, int], ...] = ()  # (payload, cost) per chunk; () is one whole unit
    unbatched: int = 1  # parts not yet taken into a batch
    outputs: dict[int, ItemOutput] = field(default_factory=dict)
    failed: bool = False

    def payload_of(self, part: int) -> Any:
        return self.parts[part][0] if self.parts else self.payload

    def add_output(self, part: int, out: ItemOutput) -> ItemOutput | None:
        """Record one part's output; the whole output once every part has one."""
        if not self.parts:
            return out
        self.outputs[part] = out
        if len(self.outputs) < len(self.parts):
            return None
        return concat_outputs([self.outputs.pop(i) for i in range(len(self.parts))])

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

    def open(self, key: bytes, payload: Any, cost: int, slot: Slot,
             parts: tuple[tuple[Any, int], ...] = ()) -> Flight:
        if key in self._by_key:
            raise KeyError(f"flight {key.hex()} already open")
        flight = Flight(key, payload, cost, slot, [slot], tuple(parts), max(1, len(parts)))
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


def concat_outputs(outputs: list[ItemOutput]) -> ItemOutput:
    """The parts of one item, rows in part order (tokens are t-major in every tower)."""
    import torch

    if len(outputs) == 1:
        return outputs[0]
    emb = torch.cat([o.embedding for o in outputs])
    deep = outputs[0].deepstack
    if deep is not None:
        deep = tuple(torch.cat([o.deepstack[j] for o in outputs]) for j in range(len(deep)))  # type: ignore[index]
    return ItemOutput(emb, deep)
