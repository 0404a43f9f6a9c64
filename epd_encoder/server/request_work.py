# SPDX-License-Identifier: Apache-2.0
"""The front's per-request bookkeeping: pinned hits and staged keys it holds, each
item's place in the preprocessing bound, and the all-or-none wait on a request's
item tasks. Event-loop side, except where noted."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Callable

from epd_encoder.errors import Cancelled

__all__ = ["ItemWork", "Pins", "all_or_none", "call_soon", "on_loop"]


class Pins:
    """What a request holds until it ends: cache hits it pinned at the front (an entry
    cannot be evicted between the front's check and the engine's lookup, which would
    decode on the engine thread), and the staged keys it joined (``keep``).

    ``release`` closes it: a take after the request ended would pin forever.
    """

    def __init__(self, cache: Any) -> None:
        self.cache, self.keys, self.closed = cache, [], False
        self._kept: list[Callable[[], None]] = []
        self._lock = threading.Lock()  # release may run on the engine thread (push sinks)

    def take(self, key: bytes) -> bool:
        """Pin ``key`` if cached; raises ``Cancelled`` once the request has released."""
        with self._lock:
            if self.closed:
                raise Cancelled("the request already ended")
            if not self.cache.pin(key):
                return False
            self.keys.append(key)
            return True

    def keep(self, let_go: Callable[[], None]) -> None:
        """Call ``let_go`` (from any thread) when the request ends; once it has, call it
        now and raise ``Cancelled``."""
        with self._lock:
            if not self.closed:
                self._kept.append(let_go)
                return
        let_go()
        raise Cancelled("the request already ended")

    def release(self) -> None:
        with self._lock:
            self.closed, keys, self.keys = True, self.keys, []
            kept, self._kept = self._kept, []
        for key in keys:
            self.cache.release(key)
        for let_go in kept:
            let_go()


class ItemWork:
    """One item's place in the preprocessing bound, given back once the item's task has
    ended and no pool job it abandoned is still running: a job a thread has started
    cannot be stopped, so it counts until it really ends. Event-loop only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, give_back: Callable[[], None]) -> None:
        self._loop, self._give_back, self._open = loop, give_back, 1  # 1: the item's task

    def abandon(self, job: Future) -> None:
        """The item no longer waits for ``job``: cancel it if queued, else count it until it ends."""
        if job.cancel() or job.done():
            return
        self._open += 1
        job.add_done_callback(lambda _job: self._soon(self.end))

    def end(self, *_: Any) -> None:
        self._open -= 1
        if self._open == 0:
            self._give_back()

    def _soon(self, fn: Callable[[], None]) -> None:
        call_soon(self._loop, fn)


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nothing counts any more
        pass


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` now when called on ``loop``'s thread, else posted to it (``call_soon``)."""
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        fn(*args)
    else:
        call_soon(loop, fn, *args)


async def all_or_none(tasks: list[asyncio.Task], timeout: float) -> list:
    """The tasks' results in order. The first failure, the timeout or the caller's
    cancellation cancels every other task and waits until each has stopped, so no
    item of a request still runs (or pins) once the request has failed."""
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if pending:
            raise asyncio.TimeoutError
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        if any(not task.done() for task in tasks):
            await asyncio.wait(tasks)
