# SPDX-License-Identifier: Apache-2.0
"""The front's budget of host bytes held by images being decoded (docs/operations.md, "Memory")."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable


class ByteBudget:
    """Predicted decode + stage bytes in flight across requests. Event-loop only.

    Waiters are admitted in arrival order, so a large image is never overtaken
    for ever by small ones; one over the whole capacity is admitted alone, once
    nothing else holds any. ``on_drained(freed)`` runs each time it empties.
    """

    def __init__(self, capacity: int, on_drained: Callable[[int], None] | None = None) -> None:
        self.capacity, self.used, self.peak = capacity, 0, 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._on_drained, self._freed = on_drained, 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.capacity

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            return self._take(n)
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except BaseException:
            if entry[1].done() and not entry[1].cancelled():
                self.release(n)  # admitted just as the waiter left
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()  # it may have been the head that blocked the rest
            raise

    def release(self, n: int) -> None:
        self.used -= n
        self._freed += n
        self._wake()
        if self.used == 0 and self._on_drained is not None:
            freed, self._freed = self._freed, 0
            self._on_drained(freed)

    def _wake(self) -> None:
        while self._waiters and (self._waiters[0][1].done() or self._fits(self._waiters[0][0])):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)
