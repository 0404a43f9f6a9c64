# SPDX-License-Identifier: Apache-2.0
"""In-flight coalescing: one encode per content key, however many wait for it.

Pure bookkeeping, no tensors. A *flight* is one key being encoded; its
*waiters* are the ``(request_id, item_index)`` slots that want the result.
The first waiter opened the flight (its cache state is ``miss``); later ones
attached to it (``coalesced``). Invariants: a flight exists iff it has at least
one waiter; a unit id names at most one flight; a key has at most one flight
that new slots may join, and none when coalescing is off (``coalesce=False``:
each miss opens its own flight under its own unit id, for baseline runs).

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
    unit_id: str = ""  # the scheduler's id for this flight (its parts are its item indices)

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


def opener_unit_id(slot: Slot) -> str:
    """A flight's unit id named after the slot that opened it: unique among open flights
    when no flight outlives its opener (coalescing off), and ordered by (request id,
    item index). The suffix after the last ``#`` is digits only, so the name is injective."""
    return f"{slot[0]}#{slot[1]:06d}"


class InflightTable:
    """Flights by unit id, the joinable flight per key, and the reverse index from
    requests to their flights' unit ids."""

    def __init__(self, *, coalesce: bool = True) -> None:
        self._coalesce = coalesce
        self._by_unit: dict[str, Flight] = {}
        self._by_key: dict[bytes, Flight] = {}  # joinable flights (coalescing on only)
        self._by_request: dict[str, set[str]] = {}
        self.coalesced_total = 0

    @property
    def coalesce(self) -> bool:
        return self._coalesce

    def __len__(self) -> int:
        return len(self._by_unit)

    def __contains__(self, key: bytes) -> bool:
        """Whether a new slot for ``key`` would join a flight (never, with coalescing off)."""
        return key in self._by_key

    def unit(self, unit_id: str) -> Flight | None:
        return self._by_unit.get(unit_id)

    def open(self, key: bytes, payload: Any, cost: int, slot: Slot,
             parts: tuple[tuple[Any, int], ...] = ()) -> Flight:
        """Open a flight for ``slot``: its unit id is the key (one per key) when
        coalescing, else named after ``slot``."""
        if key in self._by_key:
            raise KeyError(f"flight {key.hex()} already open")
        unit_id = key.hex() if self._coalesce else opener_unit_id(slot)
        if unit_id in self._by_unit:
            raise KeyError(f"unit {unit_id!r} already open")
        flight = Flight(key, payload, cost, slot, [slot], tuple(parts), max(1, len(parts)), unit_id=unit_id)
        self._by_unit[unit_id] = flight
        if self._coalesce:
            self._by_key[key] = flight
        self._by_request.setdefault(slot[0], set()).add(unit_id)
        return flight

    def attach(self, key: bytes, slot: Slot) -> Flight:
        flight = self._by_key[key]
        flight.waiters.append(slot)
        self._by_request.setdefault(slot[0], set()).add(flight.unit_id)
        self.coalesced_total += 1
        return flight

    def land(self, flight: Flight) -> Flight:
        """Close the flight (its encode finished or failed) and return it."""
        del self._by_unit[flight.unit_id]
        if self._by_key.get(flight.key) is flight:
            del self._by_key[flight.key]
        for rid, _ in flight.waiters:
            units = self._by_request.get(rid)
            if units is not None:
                units.discard(flight.unit_id)
                if not units:
                    del self._by_request[rid]
        return flight

    def detach_request(self, request_id: str) -> Iterator[Flight]:
        """Remove every slot of a request; yield the flights left with no waiter.

        Those flights are closed: the caller must unschedule them. Sorted by unit
        id, so every rank replaying the same calls unschedules in the same order.
        """
        for unit_id in sorted(self._by_request.pop(request_id, ())):
            flight = self._by_unit[unit_id]
            flight.waiters = [s for s in flight.waiters if s[0] != request_id]
            if not flight.waiters:
                del self._by_unit[unit_id]
                if self._by_key.get(flight.key) is flight:
                    del self._by_key[flight.key]
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
