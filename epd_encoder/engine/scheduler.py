# SPDX-License-Identifier: Apache-2.0
"""Packs pending vision items into batches, one batch per vision-tower forward."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

ItemKey = tuple[str, int]


@dataclass(frozen=True)
class PendingEncodeItem:
    """One cache miss waiting for the tower: ``cost`` is in budget units (>= 1).

    ``(request_id, item_index)`` is the item's key in the scheduler.
    """

    request_id: str
    item_index: int
    cost: int

    def __post_init__(self) -> None:
        if self.cost < 1:
            raise ValueError(f"cost must be >= 1, got {self.cost!r}")


class _Entry:
    __slots__ = ("key", "item", "cost", "skips", "arrival")

    def __init__(self, key: ItemKey, item: PendingEncodeItem, arrival: float) -> None:
        self.key = key
        self.item = item
        self.cost = item.cost
        self.skips = 0
        self.arrival = arrival


class EncodeScheduler:
    """Deterministic, starvation-bounded batch packing in arrival order.

    Pending items are kept in arrival order: the order of the first ``add`` of
    each key, which is the same on every rank that sees the same calls. Ids,
    ``hash()`` and wall time play no part in forming a batch, so ranks of a
    tensor-parallel tower that replay the same ``add``/``cancel``/``next_batch``
    calls form identical batches (a differing batch would hang the collectives).

    A batch is formed by one scan from the oldest item: an item is taken if it
    fits the remaining ``max_batch_cost`` (the first item is always taken, and
    goes alone if its cost alone exceeds the budget); the scan stops at
    ``max_batch_items`` items, an exhausted budget, the ``lookahead + 1``-th item
    that does not fit, or a non-fitting item that has already been passed over
    ``max_skips`` times. A batch *passes over* an item when it leaves it pending
    and takes a younger one. Guarantees, for any sequence of calls:

    * every non-empty batch holds the oldest pending item;
    * each batch respects the cost budget and the item cap, except a batch of
      one item whose cost alone exceeds the budget;
    * no item is passed over more than ``max_skips`` times; once it has been,
      no younger item is taken before it, so the younger work encoded ahead of
      an item is at most ``max_skips * max_batch_cost``;
    * an item with ``n`` older items pending is in one of the next ``n + 1``
      non-empty batches (older items never multiply: a re-``add`` keeps its
      position), whatever request ids arrive meanwhile.

    ``max_wait_s > 0`` lets ``next_batch`` return ``[]`` while the batch would
    take everything pending and still be under both limits, until the oldest
    item has waited ``max_wait_s`` on ``clock``. That decision reads the clock,
    so under tensor parallelism take it on rank 0 only (``time_until_ready``)
    and broadcast it; other ranks run with ``max_wait_s=0`` and call
    ``next_batch()`` on the signal. The default ``0`` never waits and is fully
    deterministic.

    ``next_batch`` costs O(B + L) for a batch of ``B`` items with ``L`` items
    looked past, independent of the pending count; ``add``, ``pending_cost``
    and ``in`` are O(1); ``cancel`` is O(items of that request). Not
    thread-safe: one engine loop owns it.
    """

    def __init__(
        self,
        max_batch_cost: int = 16384,
        max_batch_items: int = 64,
        *,
        lookahead: int = 64,
        max_skips: int = 8,
        max_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_cost <= 0:
            raise ValueError(f"max_batch_cost must be positive, got {max_batch_cost!r}")
        if max_batch_items <= 0:
            raise ValueError(f"max_batch_items must be positive, got {max_batch_items!r}")
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead!r}")
        if max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {max_skips!r}")
        if not max_wait_s >= 0.0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
        self._max_cost = max_batch_cost
        self._max_items = max_batch_items
        self._lookahead = lookahead
        self._max_skips = max_skips
        self._max_wait_s = float(max_wait_s)
        self._clock = clock
        # Insertion order is the arrival sequence; O(1) removal anywhere.
        self._queue: OrderedDict[ItemKey, _Entry] = OrderedDict()
        self._by_request: dict[str, dict[int, None]] = {}
        self._cost = 0

    @property
    def max_batch_cost(self) -> int:
        return self._max_cost

    @property
    def max_batch_items(self) -> int:
        return self._max_items

    def add(self, item: PendingEncodeItem, now: float | None = None) -> None:
        """Queue ``item``; re-adding a pending key replaces it in place.

        A replacement keeps the original arrival position, pass-over count and
        arrival time, so re-adding can neither starve an item nor jump it
        ahead. ``now`` (default ``clock()``) stamps arrival for ``max_wait_s``.
        """
        key = (item.request_id, item.item_index)
        entry = self._queue.get(key)
        if entry is not None:
            self._cost += item.cost - entry.cost
            entry.item, entry.cost = item, item.cost
            return
        if self._max_wait_s > 0.0 and now is None:
            now = self._clock()
        self._queue[key] = _Entry(key, item, 0.0 if now is None else now)
        self._by_request.setdefault(item.request_id, {})[item.item_index] = None
        self._cost += item.cost

    def next_batch(self, now: float | None = None) -> list[PendingEncodeItem]:
        """Pop the next batch, in arrival order; ``[]`` if none is due.

        ``[]`` means nothing is pending, or (only with ``max_wait_s > 0``) that
        the batch is still filling; ``time_until_ready`` says for how long.
        """
        if not self._queue:
            return []
        if self._max_wait_s > 0.0 and self.time_until_ready(now):
            return []
        taken, passed_over = self._scan()
        for entry in passed_over:
            entry.skips += 1
        queue, by_request = self._queue, self._by_request
        for entry in taken:
            del queue[entry.key]
            rid, index = entry.key
            indices = by_request[rid]
            del indices[index]
            if not indices:
                del by_request[rid]
            self._cost -= entry.cost
        return [entry.item for entry in taken]

    def peek_batch(self) -> list[PendingEncodeItem]:
        """The batch ``next_batch`` would form now, ignoring ``max_wait_s``; changes
        nothing (no pass-over counts, no clock), so a caller may preview the next
        batch on one rank without the ranks' scheduler states diverging."""
        return [entry.item for entry in self._scan()[0]] if self._queue else []

    def _scan(self) -> tuple[list[_Entry], list[_Entry]]:
        """One scan from the oldest item: the entries taken and those passed over."""
        remaining, cap = self._max_cost, self._max_items
        lookahead, max_skips = self._lookahead, self._max_skips
        taken: list[_Entry] = []
        skipped: list[_Entry] = []
        passed = 0  # skipped[:passed] lie before a taken item: passed over
        for entry in self._queue.values():
            cost = entry.cost
            if cost <= remaining or not taken:
                taken.append(entry)
                remaining -= cost
                passed = len(skipped)
                if len(taken) == cap or remaining <= 0:
                    break
            elif entry.skips >= max_skips or len(skipped) == lookahead:
                break
            else:
                skipped.append(entry)
        return taken, skipped[:passed]

    def time_until_ready(self, now: float | None = None) -> float | None:
        """Seconds until ``next_batch`` would return a batch: ``None`` if
        nothing is pending, ``0.0`` if a batch is due now."""
        if not self._queue:
            return None
        if (
            self._max_wait_s <= 0.0
            or len(self._queue) >= self._max_items
            or self._cost >= self._max_cost
        ):
            return 0.0
        # Under both limits, a batch would take everything: wait on the oldest.
        oldest = next(iter(self._queue.values()))
        if now is None:
            now = self._clock()
        return max(0.0, oldest.arrival + self._max_wait_s - now)

    def cancel(self, request_id: str) -> int:
        """Remove every pending item of ``request_id``; return how many."""
        indices = self._by_request.pop(request_id, None)
        if not indices:
            return 0
        for index in indices:
            self._cost -= self._queue.pop((request_id, index)).cost
        return len(indices)

    def pending_size(self) -> int:
        """Number of pending items."""
        return len(self._queue)

    def pending_cost(self) -> int:
        """Sum of the pending items' costs."""
        return self._cost

    def __contains__(self, key: object) -> bool:
        return key in self._queue
