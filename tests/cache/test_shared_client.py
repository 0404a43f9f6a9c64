# SPDX-License-Identifier: Apache-2.0
"""Deadlines, stuck calls, the breaker and the background connect, with fake backends."""

from __future__ import annotations

import asyncio
import threading

import pytest

from epd_encoder.cache.shared_breaker import Breaker
from epd_encoder.cache.shared_client import GuardedStore, Unavailable
from epd_encoder.cache.shared_mooncake import StoreError
from tests.e2e.harness import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Idle:
    def close(self) -> None:
        pass


def _store(backend=None, *, failures=3, clock=None, read_threads=1) -> GuardedStore:
    backend = backend if backend is not None else Idle()
    store = GuardedStore(lambda: backend, Breaker(failures, 5.0, clock or Clock()), read_threads=read_threads)
    store.start()
    assert wait_for(lambda: store.connected)
    return store


def _fail(_backend):
    raise StoreError("get", -900)


def test_a_call_past_its_deadline_is_abandoned_and_counts_as_a_failure():
    gate = threading.Event()
    store = _store(failures=1)
    try:
        with pytest.raises(Unavailable) as e:
            store.call("read", lambda b: gate.wait(30), 0.05)
        assert e.value.reason == "timeout"
        assert store.breaker.state == "open"
    finally:
        gate.set()
        store.close()


def test_a_late_success_does_not_close_the_breaker_its_timeout_opened():
    gate, returned = threading.Event(), threading.Event()
    store = _store(failures=1)

    def slow(_b):
        gate.wait(30)
        returned.set()
        return 1

    try:
        with pytest.raises(Unavailable):
            store.call("read", slow, 0.05)
        gate.set()
        assert returned.wait(10)
        assert wait_for(lambda: store.breaker.state == "open")
    finally:
        store.close()


def test_calls_queue_behind_a_stuck_one_within_their_deadline_then_the_queue_is_bounded():
    gate, entered, ran = threading.Event(), threading.Event(), []
    store = GuardedStore(lambda: Idle(), Breaker(10, 5.0), read_threads=1, queue_per_thread=2)
    store.start()
    assert wait_for(lambda: store.connected)

    def stuck(_b):
        entered.set()
        gate.wait(30)

    try:
        store.submit("read", stuck)
        assert entered.wait(10)
        with pytest.raises(Unavailable) as e:  # queued behind it, then past its deadline
            store.call("read", lambda b: ran.append("late"), 0.05)
        assert e.value.reason == "timeout"
        queued = [store.submit("read", lambda b, i=i: ran.append(i))[0] for i in range(2)]
        with pytest.raises(Unavailable) as e:  # one thread and two queued: the bound
            store.call("read", lambda b: 1, 30)
        assert e.value.reason == "busy"
        assert store.call("write", lambda b: 2, 30) == 2  # writes have their own thread
        gate.set()
        for f in queued:
            f.result(10)
        assert ran == [0, 1]  # the call that timed out while queued never ran
    finally:
        gate.set()
        store.close()


def test_store_errors_open_the_breaker_then_calls_skip_the_store():
    clock, calls = Clock(), []
    store = _store(failures=3, clock=clock)
    try:
        for _ in range(3):
            with pytest.raises(Unavailable) as e:
                store.call("read", _fail, 10)
            assert e.value.reason == "error"
        with pytest.raises(Unavailable) as e:
            store.call("read", lambda b: calls.append(1), 10)
        assert e.value.reason == "open" and not calls
        clock.now = 5.0  # the cooldown has passed: one probe, which succeeds
        assert store.call("read", lambda b: 7, 10) == 7
        assert store.breaker.state == "closed"
    finally:
        store.close()


def test_an_error_that_is_not_the_stores_does_not_count_against_it():
    store = _store(failures=1)
    try:
        with pytest.raises(ValueError):
            store.call("read", lambda b: int("x"), 10)
        assert store.breaker.state == "closed"
    finally:
        store.close()


def test_acall_waits_without_blocking_the_loop():
    gate = threading.Event()
    store = _store(failures=5)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.ensure_future(ticker())
        with pytest.raises(Unavailable):
            await store.acall("read", lambda b: gate.wait(30), 0.2)
        t.cancel()
        return ticks

    try:
        assert asyncio.run(main()) > 5  # the loop kept running while the call hung
    finally:
        gate.set()
        store.close()


def test_until_connected_calls_are_down_and_a_failed_connect_is_retried():
    attempts, release = [], threading.Event()

    def connect():
        attempts.append(1)
        if len(attempts) == 1:
            raise StoreError("setup", -1)
        release.wait(30)
        return Idle()

    store = GuardedStore(connect, Breaker(3, 5.0), read_threads=1, retry_s=0.01)
    store.start()
    try:
        assert wait_for(lambda: len(attempts) == 2)
        with pytest.raises(Unavailable) as e:
            store.call("read", lambda b: 1, 10)
        assert e.value.reason == "down"
        release.set()
        assert wait_for(lambda: store.connected)
        assert store.call("read", lambda b: 1, 10) == 1
    finally:
        release.set()
        store.close()


def test_close_leaves_a_client_with_a_stuck_call_open():
    gate, closed = threading.Event(), []

    class Backend:
        def close(self):
            closed.append(1)

    store = _store(Backend())
    future, _ = store.submit("read", lambda b: gate.wait(30))
    store.close(timeout_s=0.1)
    assert not closed
    gate.set()
    future.result(10)
    store2 = _store(Backend())
    store2.close()
    assert closed == [1]


def test_a_late_error_after_a_timeout_is_not_reported_as_unretrieved(caplog):
    gate, failed = threading.Event(), threading.Event()
    store = _store(failures=5)

    def late(_b):
        gate.wait(30)
        failed.set()
        raise StoreError("get", -900)

    async def main():
        with pytest.raises(Unavailable):
            await store.acall("read", late, 0.05)
        gate.set()
        await asyncio.get_running_loop().run_in_executor(None, failed.wait, 10)
        for _ in range(5):  # let the wrapped future's callbacks run
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        import gc

        gc.collect()  # an unretrieved exception is logged when its future is collected
        assert "never retrieved" not in caplog.text
    finally:
        gate.set()
        store.close()
