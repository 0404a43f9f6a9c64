# SPDX-License-Identifier: Apache-2.0
"""The front's budget of host bytes: images being decoded, and what queued items hold
(docs/operations.md, "Memory")."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Callable

from epd_encoder.server.request_work import on_loop


class ByteBudget:
    """Host bytes the server holds for work it accepted, in two kinds of charge.

    ``acquire``/``release`` (event loop): the predicted peak of a decode, gated.
    Waiters are admitted in arrival order, so a large image is never overtaken
    for ever by small ones; a decode that does not fit is admitted alone once no
    other decode runs, so held bytes slow decoding down but never stop it.
    ``hold``/``unhold`` (any thread): bytes already materialized for a queued item
    (staged pixels, the prefetched batch), charged until the item ends, never refused.
    ``on_drained(freed)`` runs (on the loop) each time decoding drains.
    """

    def __init__(self, capacity: int, on_drained: Callable[[int], None] | None = None) -> None:
        self.capacity, self.decoding, self.peak = capacity, 0, 0
        self._held = 0
        self._lock = threading.Lock()  # ``hold``/``unhold`` come from the engine and prefetch threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._on_drained, self._freed = on_drained, 0

    @property
    def used(self) -> int:
        return self.decoding + self._held

    @property
    def held(self) -> int:
        return self._held

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, n: int) -> bool:
        return self.decoding == 0 or self.used + n <= self.capacity

    def _take(self, n: int) -> None:
        self.decoding += n
        self.peak = max(self.peak, self.used)

    async def acquire(self, n: int) -> None:
        self._loop = asyncio.get_running_loop()
        if not self._waiters and self._fits(n):
            return self._take(n)
        entry = (n, self._loop.create_future())
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
        self.decoding -= n
        self._freed += n
        self._wake()
        if self.decoding == 0 and self._on_drained is not None:
            freed, self._freed = self._freed, 0
            self._on_drained(freed)

    def hold(self, n: int) -> None:
        """Charge ``n`` bytes held for a queued item (any thread); ``unhold`` gives them back."""
        with self._lock:
            self._held += n
            self.peak = max(self.peak, self.used)

    def unhold(self, n: int) -> None:
        with self._lock:
            self._held -= n
        if self._loop is not None and self._waiters:
            on_loop(self._loop, self._wake)

    def _wake(self) -> None:
        while self._waiters and (self._waiters[0][1].done() or self._fits(self._waiters[0][0])):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)
