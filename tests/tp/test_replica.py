# SPDX-License-Identifier: Apache-2.0
"""Replicated scheduling (``tp/replica.py``): a replica that replays rank 0's recorded calls,
drained at any points, forms every batch rank 0 formed; the calls survive the wire; and a
replica whose scheduler differs is caught by the digest."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_encoder.config import EngineConfig, SchedulerConfig
from epd_encoder.engine.build import build_scheduler
from epd_encoder.engine.scheduler import EncodeScheduler, PendingEncodeItem
from epd_encoder.tp.messages import Add, Cancel, Heartbeat, Take, Work, decode, encode
from epd_encoder.tp.replica import CallLog, RecordingScheduler, SchedulerReplica, replica_args, served_digest

CONFIG = SchedulerConfig(max_batch_cost=64, max_batch_items=4, lookahead=3, max_skips=2)


def work(calls) -> Work:
    return Work(seq=1, mode="t", request_ids=["x"], item_indices=[0], costs=[1], grids=[(1, 1, 1)],
                num_tokens=[1], shapes=[[1]], dtype="float32", calls=calls)


def rank0(config: SchedulerConfig = CONFIG, **extra) -> tuple[RecordingScheduler, CallLog]:
    log = CallLog()
    inner = EncodeScheduler(max_batch_cost=config.max_batch_cost, max_batch_items=config.max_batch_items,
                            lookahead=config.lookahead, max_skips=config.max_skips, **extra)
    return RecordingScheduler(inner, log), log


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 11), st.integers(0, 2), st.integers(1, 80)),
    st.tuples(st.just("cancel"), st.integers(0, 11)),
    st.tuples(st.just("next"), st.booleans()),  # sent: False when the batch fails rank 0's checks
    st.tuples(st.just("ship")),
), max_size=120)


@pytest.mark.parametrize("scheduling", ["lookahead", "reference"])
@settings(max_examples=150, deadline=None)
@given(script=ops)
def test_a_replica_forms_every_batch_rank_0_formed(scheduling, script):
    """Rank 0 and a replica fold the same batch into every ``Work``'s digest, also when Takes
    of unsent batches (failed on rank 0 before the group) rode earlier heartbeats or ride
    along in the ``Work``; and the replica's queue ends as rank 0's."""
    config = dataclasses.replace(CONFIG, scheduling=scheduling)
    log = CallLog()
    sched = RecordingScheduler(build_scheduler(EngineConfig(scheduler=config)), log)
    replica = SchedulerReplica(**replica_args(config))

    def heartbeat() -> None:  # through the wire's encoding, as RankGroup._heartbeat sends them
        replica.replay(decode(encode(Heartbeat(0, log.drain()))).calls)

    def work_goes_out(batch) -> None:  # RankGroup.run: drain, then each side's latest batch
        w = decode(encode(work(log.drain())))
        ours = log.latest()
        assert ours == batch and replica.digest(w, w.digest()) == served_digest(w.digest(), ours)

    for op in script:
        if op[0] == "add":
            sched.add(PendingEncodeItem(f"u{op[1]}", op[2], op[3]))
        elif op[0] == "cancel":
            sched.cancel(f"u{op[1]}")
        elif op[0] == "next":
            batch = sched.next_batch()
            if batch and op[1]:
                work_goes_out(batch)
        else:
            heartbeat()
    heartbeat()
    assert len(log) == 0 and replica.pending_size() == sched.pending_size()


def test_the_take_of_an_unsent_batch_rides_a_heartbeat_and_the_next_work_still_agrees():
    sched, log = rank0()
    replica = SchedulerReplica(**replica_args(CONFIG))
    for rid in "abcdef":
        sched.add(PendingEncodeItem(rid, 0, 30))
    unsent = sched.next_batch()  # fails rank 0's checks: never a Work
    assert unsent and log.latest() == unsent
    calls = decode(encode(Heartbeat(0, log.drain()))).calls
    assert calls[-1] == Take()
    replica.replay(calls)  # the idle heartbeat carries the Take
    assert replica.pending_size() == sched.pending_size()
    batch = sched.next_batch()
    w = work(log.drain())
    assert w.calls == [Take()] and batch != unsent
    assert replica.digest(w, w.digest()) == served_digest(w.digest(), batch)
    assert replica.pending_size() == sched.pending_size()


def test_only_calls_that_change_the_scheduler_are_recorded():
    sched, log = rank0()
    assert sched.next_batch() == [] and sched.cancel("nobody") == 0
    assert log.drain() == []  # an empty batch and a cancel of nothing change nothing
    sched.add(PendingEncodeItem("a", 0, 5))
    sched.cancel("a")
    assert log.drain() == [Add("a", 0, 5), Cancel("a")]


def test_a_batch_held_to_fill_on_rank_0_is_not_a_call():
    # max_wait_s is rank 0's clock decision: the replica (no wait) takes only on a Take.
    clock = [0.0]
    sched, log = rank0(max_wait_s=1.0, clock=lambda: clock[0])
    replica = SchedulerReplica(**replica_args(CONFIG))
    sched.add(PendingEncodeItem("a", 0, 5))
    assert sched.next_batch() == []  # still filling
    replica.replay(log.drain())
    assert replica.latest() is None and replica.pending_size() == 1
    clock[0] = 2.0
    batch = sched.next_batch()
    replica.replay(log.drain())
    assert batch and replica.latest() == batch


def test_the_latest_batch_goes_to_one_work_only():
    sched, log = rank0()
    sched.add(PendingEncodeItem("a", 0, 5))
    batch = sched.next_batch()
    assert log.latest() == batch and log.latest() is None


def test_the_digest_covers_the_batch_each_rank_formed():
    w = work([Add("a", 0, 5), Add("b", 0, 7), Take()])
    base = w.digest()
    same = SchedulerReplica(**replica_args(CONFIG)).digest(w, base)
    assert same == SchedulerReplica(**replica_args(CONFIG)).digest(w, base) != base
    # A rank whose scheduler takes one item per batch forms [a], not [a, b]: another digest.
    narrow = SchedulerReplica(**replica_args(dataclasses.replace(CONFIG, max_batch_items=1)))
    assert narrow.digest(w, base) != same
    assert served_digest(base, None) == base  # outside a server, the Work alone


def test_replica_args_are_json_and_drop_the_wait():
    import json

    args = replica_args(dataclasses.replace(CONFIG, max_wait_ms=5.0))
    assert json.loads(json.dumps(args)) == args and args["max_wait_ms"] == 0.0
