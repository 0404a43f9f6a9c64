# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from epd_encoder import EmbeddingCache, EncodeScheduler
from epd_encoder.engine.loop import EngineLoop, FutureSink
from epd_encoder.engine.worker import EncodeRequest, EncodeWorker, WorkItem
from epd_encoder.errors import DuplicateRequest, NotReady, Overloaded
from tests.engine.fakes import FakeExecutor, key_of


class SlowExecutor(FakeExecutor):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def encode(self, payloads):
        self.entered.set()
        self.gate.wait(10)
        time.sleep(self.delay)
        return super().encode(payloads)


def make_loop(executor, *, max_pending_cost=None, capacity=1 << 24):
    cache = EmbeddingCache(capacity_bytes=capacity)

    def factory(deliverer):
        return EncodeWorker(executor=executor,
                            scheduler=EncodeScheduler(max_batch_cost=64, max_batch_items=4),
                            cache=cache, deliverer=deliverer)

    return EngineLoop(factory, max_pending_cost=max_pending_cost, idle_wait_s=0.05).start()


def submit(loop, rid, *names, cost=8):
    sink = FutureSink()
    loop.submit(EncodeRequest(rid, tuple(WorkItem(key_of(n), cost, n) for n in names)), sink)
    return sink


def test_many_threads_with_duplicates_encode_each_key_once():
    ex = SlowExecutor(0.002)
    loop = make_loop(ex)
    names = [f"img{i}" for i in range(12)]

    def client(c):
        sink = submit(loop, f"c{c}", *[names[(c * 7 + j) % 12] for j in range(3)])
        res = sink.future.result(10)
        res.release()
        return res

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(client, range(64)))
    loop.stop()
    assert all(r.outcome.state == "done" and len(r.items) == 3 for r in results)
    assert max(ex.encoded.values()) == 1 and set(ex.encoded) == set(names)
    states = [i.cache for r in results for i in r.items]
    assert states.count("miss") == 12 and states.count("hit") + states.count("coalesced") == 64 * 3 - 12


def test_admission_is_decided_at_once_even_behind_a_running_forward():
    ex = SlowExecutor(0.0)
    ex.gate.clear()  # hold the first batch in the tower
    loop = make_loop(ex, max_pending_cost=20)
    sink_a = submit(loop, "a", "x")
    assert ex.entered.wait(5)
    with pytest.raises(DuplicateRequest):
        submit(loop, "a", "y")
    with pytest.raises(Overloaded):
        submit(loop, "b", "y", "z")  # 8 outstanding + 16 > 20
    sink_c = submit(loop, "c", "w", "w")  # same key twice counts once: 8 + 8 <= 20
    assert loop.outstanding_cost == 16
    ex.gate.set()
    assert sink_a.future.result(5).outcome.state == "done"
    assert sink_c.future.result(5).outcome.state == "done"
    loop.stop()
    assert loop.outstanding_cost == 0 and loop.active_requests == 0


def test_stop_drains_in_flight_work_then_refuses():
    ex = SlowExecutor(0.01)
    loop = make_loop(ex)
    sinks = [submit(loop, f"r{i}", f"k{i}") for i in range(10)]
    loop.stop(drain=True, timeout=10)
    assert all(s.future.result(0).outcome.state == "done" for s in sinks)
    with pytest.raises(NotReady):
        submit(loop, "late", "k0")


def test_stop_without_drain_cancels_everything_once():
    ex = SlowExecutor(0.0)
    ex.gate.clear()
    loop = make_loop(ex)
    sinks = [submit(loop, f"r{i}", f"k{i}") for i in range(6)]
    assert ex.entered.wait(5)  # one batch (up to 4 items) is in the tower, the rest queued
    loop.stop(drain=False, timeout=0)  # returns at once: the stop is requested, not yet done
    ex.gate.set()
    states = [s.future.result(10).outcome.state for s in sinks]
    in_tower = states.count("done")  # the batch finishes; nothing queued behind it runs
    assert 1 <= in_tower <= 4 and states == ["done"] * in_tower + ["cancelled"] * (6 - in_tower)
    loop.stop(drain=False, timeout=10)  # joins the engine thread
    assert not loop.running


def test_an_engine_bug_fails_the_active_requests_and_the_loop_keeps_serving():
    ex = SlowExecutor(0.0)
    loop = make_loop(ex)
    real_step = loop.worker.step
    calls = {"n": 0}

    def buggy_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("bookkeeping bug")
        return real_step()

    loop.worker.step = buggy_step
    first = submit(loop, "first", "a")
    assert first.future.result(5).outcome.state == "failed"
    assert "bookkeeping bug" in str(first.future.result(5).outcome.error)
    second = submit(loop, "second", "b")
    assert second.future.result(5).outcome.state == "done"
    assert loop.running
    loop.stop()


def hold_engine(loop):
    """Block the engine thread once it reaches this command (as a long forward would).
    Returns (gate, holding): ``holding`` is set while it waits, ``gate`` lets it go on."""
    gate, holding = threading.Event(), threading.Event()
    loop.call(lambda _worker: (holding.set(), gate.wait(10)))
    return gate, holding


def test_a_key_already_charged_is_admitted_at_no_cost():
    ex = SlowExecutor(0.0)
    loop = make_loop(ex, max_pending_cost=12)  # one and a half items
    gate, holding = hold_engine(loop)
    assert holding.wait(5)
    sinks = [submit(loop, f"dup{i}", "x") for i in range(8)]  # one queued encode serves all
    assert loop.outstanding_cost == 8 and loop.active_requests == 8
    with pytest.raises(Overloaded):
        submit(loop, "other", "y")  # new work is still bounded: 8 + 8 > 12
    both = submit(loop, "both", "x", "x")
    assert loop.outstanding_cost == 8
    gate.set()
    results = [s.future.result(5) for s in (*sinks, both)]
    assert all(r.outcome.state == "done" for r in results) and ex.encoded["x"] == 1
    assert sorted(i.cache for r in results for i in r.items) == ["coalesced"] * 9 + ["miss"]
    loop.call(lambda _worker: None).result(5)  # the engine thread has finished every request
    assert loop.outstanding_cost == 0 and loop.active_requests == 0
    assert submit(loop, "later", "y", "z").future.result(5).outcome.state == "done"
    loop.stop()
    assert loop.outstanding_cost == 0


def test_a_charge_stays_until_its_last_holder_ends():
    ex = SlowExecutor(0.0)
    loop = make_loop(ex, max_pending_cost=100)
    gate, holding = hold_engine(loop)
    assert holding.wait(5)
    first = submit(loop, "first", "x")
    second = submit(loop, "second", "x", "y")
    assert loop.outstanding_cost == 16
    loop.cancel("first")
    again, holding = hold_engine(loop)  # queued behind the cancel, so before any step
    gate.set()
    assert holding.wait(5)
    assert first.future.result(5).outcome.state == "cancelled"
    assert loop.outstanding_cost == 16  # "second" still holds x, queued for it alone
    again.set()
    assert second.future.result(5).outcome.state == "done" and ex.encoded["x"] == 1
    loop.stop()
    assert loop.outstanding_cost == 0


def test_precheck_refuses_only_new_keys_once_the_bound_is_reached():
    loop = make_loop(SlowExecutor(0.0), max_pending_cost=8)  # exactly one item
    gate, holding = hold_engine(loop)
    assert holding.wait(5)
    queued = submit(loop, "first", "x")
    assert loop.outstanding_cost == 8  # at the bound
    loop.precheck("dup")  # before any work: only 409 / 503
    loop.precheck("dup", {key_of("x"): 8})  # a duplicate of queued work costs nothing
    with pytest.raises(Overloaded):
        loop.precheck("new", {key_of("y"): 8})
    with pytest.raises(DuplicateRequest):
        loop.precheck("first")
    gate.set()
    assert queued.future.result(5).outcome.state == "done"
    loop.stop()
    with pytest.raises(NotReady):
        loop.precheck("late")


def test_without_coalescing_each_duplicate_is_charged_for_its_own_encode():
    ex = SlowExecutor(0.0)
    cache = EmbeddingCache(capacity_bytes=1 << 24)
    loop = EngineLoop(lambda d: EncodeWorker(executor=ex, scheduler=EncodeScheduler(max_batch_cost=64),
                                             cache=cache, deliverer=d, coalesce=False),
                      max_pending_cost=12, idle_wait_s=0.05).start()
    gate, holding = hold_engine(loop)
    assert holding.wait(5)
    first = submit(loop, "first", "x")
    with pytest.raises(Overloaded):
        loop.precheck(None, {key_of("x"): 8})  # a second copy would be queued and encoded again
    with pytest.raises(Overloaded):
        submit(loop, "dup", "x")
    assert loop.outstanding_cost == 8
    gate.set()
    assert first.future.result(5).outcome.state == "done"
    loop.stop()
    assert loop.outstanding_cost == 0
