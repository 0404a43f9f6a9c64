# SPDX-License-Identifier: Apache-2.0
"""Store operations with deadlines, on dedicated threads, behind a breaker.

A store call blocks in C++ and cannot be interrupted: a call past its deadline is abandoned
(the caller gets ``Unavailable("timeout")``; one still queued is cancelled) and keeps its thread
until it returns. Calls queue for a thread, the wait counted in their deadline, up to
``queue_per_thread`` per thread; beyond that they fail at once (``busy``), so stuck calls
never collect an unbounded queue behind them. The client connects in the background (Mooncake's setup blocks ~90 s while
the master is down), so a server starts and serves misses before the store is reachable.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Literal, TypeVar

from epd_encoder.cache.shared_breaker import Breaker
from epd_encoder.cache.shared_mooncake import Backend, StoreError
from epd_encoder.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")
Reason = Literal["down", "open", "busy", "timeout", "error"]
Kind = Literal["read", "write"]


class Unavailable(Exception):
    """The operation did not run, failed in the store, or missed its deadline."""

    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(f"shared store {reason}{': ' + detail if detail else ''}")
        self.reason: Reason = reason


class _Settle:
    """First outcome wins: a call that timed out reports no late success to the breaker."""

    def __init__(self, breaker: Breaker) -> None:
        self._breaker, self._lock, self._done = breaker, threading.Lock(), False

    def __call__(self, ok: bool) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        if ok:
            self._breaker.success()
        else:
            self._breaker.failure()


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class GuardedStore:
    def __init__(self, connect: Callable[[], Backend], breaker: Breaker, *, read_threads: int,
                 write_threads: int = 1, retry_s: float = 5.0, queue_per_thread: int = 8) -> None:
        self.breaker = breaker
        self._connect, self._retry_s = connect, retry_s
        self._backend: Backend | None = None
        self._pools: dict[Kind, ThreadPoolExecutor] = {"read": ThreadPoolExecutor(read_threads, thread_name_prefix="epd-l3-read"),
                       "write": ThreadPoolExecutor(write_threads, thread_name_prefix="epd-l3-write")}
        self._sizes: dict[Kind, int] = {"read": read_threads * (1 + queue_per_thread),
                                        "write": write_threads * (1 + queue_per_thread)}
        self._slots: dict[Kind, threading.BoundedSemaphore] = {
            kind: threading.BoundedSemaphore(n) for kind, n in self._sizes.items()}
        self._closed = threading.Event()
        self._connector: threading.Thread | None = None

    @property
    def connected(self) -> bool:
        return self._backend is not None

    def start(self) -> None:
        """Connect on a background thread, retrying every ``retry_s`` until it succeeds."""
        self._connector = threading.Thread(target=self._connect_loop, name="epd-l3-connect", daemon=True)
        self._connector.start()

    def _connect_loop(self) -> None:
        while not self._closed.is_set():
            try:
                backend = self._connect()
            except ConfigError:
                log.exception("the shared cache cannot be used; it stays off")
                return
            except Exception as e:
                log.warning("shared cache: connecting failed (%s); retrying in %g s", e, self._retry_s)
                self._closed.wait(self._retry_s)
                continue
            if self._closed.is_set():
                backend.close()
                return
            self._backend = backend
            log.info("shared cache connected")
            return

    def submit(self, kind: Kind, fn: Callable[[Backend], T]) -> tuple[Future[T], _Settle]:
        """Start ``fn(backend)`` on a ``kind`` thread, or raise ``Unavailable`` at once."""
        backend = self._backend
        if backend is None or self._closed.is_set():
            raise Unavailable("down")
        slots = self._slots[kind]
        if not slots.acquire(blocking=False):
            raise Unavailable("busy")
        if not self.breaker.allow():
            slots.release()
            raise Unavailable("open")
        settle = _Settle(self.breaker)

        def run() -> T:
            try:
                out = fn(backend)
            except StoreError:
                settle(False)
                raise
            except BaseException:  # not the store's fault (a corrupt entry, say)
                settle(True)
                raise
            settle(True)
            return out

        try:
            future = self._pools[kind].submit(run)
        except RuntimeError as e:  # shut down
            slots.release()
            settle(True)
            raise Unavailable("down") from e
        future.add_done_callback(lambda _f: slots.release())  # ran, or cancelled while queued
        return future, settle

    def call(self, kind: Kind, fn: Callable[[Backend], T], deadline_s: float) -> T:
        """``fn(backend)`` within ``deadline_s``, from any thread but the event loop."""
        future, settle = self.submit(kind, fn)
        try:
            return future.result(timeout=deadline_s)
        except FutureTimeout:
            settle(False)
            future.cancel()  # still queued: it never runs
            raise Unavailable("timeout") from None
        except StoreError as e:
            raise Unavailable("error", str(e)) from e

    async def acall(self, kind: Kind, fn: Callable[[Backend], T], deadline_s: float) -> T:
        """``call`` for the event loop: it waits without blocking the loop."""
        future, settle = self.submit(kind, fn)
        waited = asyncio.wrap_future(future)
        try:
            return await asyncio.wait_for(asyncio.shield(waited), deadline_s)
        except asyncio.TimeoutError:
            settle(False)
            future.cancel()  # still queued: it never runs
            waited.add_done_callback(_consume)  # its late error is the timeout's, already counted
            raise Unavailable("timeout") from None
        except StoreError as e:
            raise Unavailable("error", str(e)) from e

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop taking operations; close the client unless a stuck call still holds a thread."""
        self._closed.set()
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        backend, self._backend = self._backend, None
        if backend is None:
            return
        idle = all(self._drained(kind) for kind in self._pools)
        if not idle:
            log.warning("shared cache: a store call is still running; the client is left open")
            return
        closer = threading.Thread(target=backend.close, name="epd-l3-close", daemon=True)
        closer.start()
        closer.join(timeout_s)  # bounded only where the backend's close releases the GIL

    def _drained(self, kind: Kind) -> bool:
        slots = self._slots[kind]
        taken = []
        try:
            while slots.acquire(blocking=False):
                taken.append(1)
        finally:
            for _ in taken:
                slots.release()
        return len(taken) == self._sizes[kind]
