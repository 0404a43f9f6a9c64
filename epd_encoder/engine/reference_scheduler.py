# SPDX-License-Identifier: Apache-2.0
"""The reference batching policy, kept as a baseline for comparisons (``--scheduling reference``)."""

from __future__ import annotations

from epd_encoder.engine.scheduler import ItemKey, PendingEncodeItem


class ReferenceScheduler:
    """Sort by id on every batch, no look-ahead: the policy common elsewhere.

    Each ``next_batch`` sorts the pending items by ``(request_id, item_index)``
    and takes them in that order until the first item that does not fit the
    remaining ``max_batch_cost`` (the first item is always taken, alone if it
    exceeds the budget), or ``max_batch_items`` items.

    It is deterministic: a batch depends only on the pending set, never on
    arrival order, ``hash()`` or wall time, so tensor-parallel ranks replaying
    the same calls form the same batches. It is NOT starvation-free, and that
    is the point of the comparison: an item whose id sorts late waits while
    items with smaller ids keep arriving and fill every batch, and one large
    item ends each batch early (no look-ahead past it). ``next_batch`` costs
    O(n log n) in the pending count. Not thread-safe: one engine loop owns it.
    """

    def __init__(self, max_batch_cost: int = 16384, max_batch_items: int = 64) -> None:
        if max_batch_cost <= 0:
            raise ValueError(f"max_batch_cost must be positive, got {max_batch_cost!r}")
        if max_batch_items <= 0:
            raise ValueError(f"max_batch_items must be positive, got {max_batch_items!r}")
        self._max_cost = max_batch_cost
        self._max_items = max_batch_items
        self._items: dict[ItemKey, PendingEncodeItem] = {}
        self._by_request: dict[str, set[int]] = {}
        self._cost = 0

    @property
    def max_batch_cost(self) -> int:
        return self._max_cost

    @property
    def max_batch_items(self) -> int:
        return self._max_items

    def add(self, item: PendingEncodeItem) -> None:
        """Queue ``item``; re-adding a pending key replaces it."""
        key = (item.request_id, item.item_index)
        old = self._items.get(key)
        self._cost += item.cost - (old.cost if old is not None else 0)
        self._items[key] = item
        self._by_request.setdefault(item.request_id, set()).add(item.item_index)

    def peek_batch(self) -> list[PendingEncodeItem]:
        """The batch ``next_batch`` would return now, changing nothing."""
        remaining, taken = self._max_cost, []  # type: int, list[PendingEncodeItem]
        for key in sorted(self._items):
            item = self._items[key]
            if taken and item.cost > remaining:
                break  # no look-ahead
            taken.append(item)
            remaining -= item.cost
            if len(taken) == self._max_items or remaining <= 0:
                break
        return taken

    def next_batch(self) -> list[PendingEncodeItem]:
        """Pop the next batch in id order; ``[]`` if nothing is pending."""
        batch = self.peek_batch()
        for item in batch:
            del self._items[(item.request_id, item.item_index)]
            indices = self._by_request[item.request_id]
            indices.discard(item.item_index)
            if not indices:
                del self._by_request[item.request_id]
            self._cost -= item.cost
        return batch

    def time_until_ready(self, now: float | None = None) -> float | None:
        """``None`` if nothing is pending, else ``0.0``: this policy never holds a batch open."""
        return 0.0 if self._items else None

    def cancel(self, request_id: str) -> int:
        """Remove every pending item of ``request_id``; return how many."""
        indices = self._by_request.pop(request_id, None)
        if not indices:
            return 0
        for index in indices:
            self._cost -= self._items.pop((request_id, index)).cost
        return len(indices)

    def pending_size(self) -> int:
        return len(self._items)

    def pending_cost(self) -> int:
        return self._cost

    def __contains__(self, key: object) -> bool:
        return key in self._items
