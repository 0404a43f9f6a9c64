# SPDX-License-Identifier: Apache-2.0
import math
import time
import tracemalloc
from pathlib import Path

import pytest

from epd_encoder.engine.scheduler import EncodeScheduler, PendingEncodeItem

REPO_ROOT = Path(__file__).resolve().parents[2]


def item(rid, idx, cost):
    return PendingEncodeItem(rid, idx, cost)


def drain(sched, now=None):
    out = []
    while batch := sched.next_batch(now):
        out.append(batch)
    return out


def keys(batch):
    return [(i.request_id, i.item_index) for i in batch]


# --- limits and packing ------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_batch_cost": 0},
        {"max_batch_cost": -5},
        {"max_batch_items": 0},
        {"max_batch_items": -1},
        {"lookahead": -1},
        {"max_skips": -1},
        {"max_wait_s": -0.1},
        {"max_wait_s": math.nan},
    ],
)
def test_bad_limits_raise(kwargs):
    with pytest.raises(ValueError):
        EncodeScheduler(**kwargs)


def test_item_cost_must_be_positive():
    with pytest.raises(ValueError):
        PendingEncodeItem("r", 0, 0)
    with pytest.raises(ValueError):
        PendingEncodeItem("r", 0, -3)


def test_empty_scheduler():
    s = EncodeScheduler(100, 4)
    assert s.next_batch() == []
    assert s.pending_size() == 0 and s.pending_cost() == 0
    assert s.time_until_ready(0.0) is None
    assert s.cancel("nope") == 0


def test_greedy_respects_budget_and_cap():
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=3)
    for i, c in enumerate([40, 30, 20, 5, 50]):
        s.add(item("r", i, c))
    assert keys(s.next_batch()) == [("r", 0), ("r", 1), ("r", 2)]  # cap of 3
    assert keys(s.next_batch()) == [("r", 3), ("r", 4)]
    assert s.next_batch() == []


def test_lookahead_fills_the_budget():
    s = EncodeScheduler(max_batch_cost=16384, max_batch_items=64, lookahead=4)
    for i, c in enumerate([10000, 10000, 6000]):
        s.add(item("r", i, c))
    assert keys(s.next_batch()) == [("r", 0), ("r", 2)]
    assert keys(s.next_batch()) == [("r", 1)]


def test_lookahead_zero_is_strict_fifo():
    s = EncodeScheduler(max_batch_cost=16384, max_batch_items=64, lookahead=0)
    for i, c in enumerate([10000, 10000, 6000]):
        s.add(item("r", i, c))
    assert [keys(b) for b in drain(s)] == [[("r", 0)], [("r", 1), ("r", 2)]]


def test_lookahead_limits_how_far_the_scan_looks():
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=64, lookahead=2)
    for i, c in enumerate([60, 50, 50, 50, 10]):
        s.add(item("r", i, c))
    # 3 items do not fit before the 10; only 2 may be looked past.
    assert keys(s.next_batch()) == [("r", 0)]


def test_oversized_item_goes_alone_and_never_blocks_progress():
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=8)
    s.add(item("big", 0, 1000))
    s.add(item("small", 0, 10))
    assert keys(s.next_batch()) == [("big", 0)]
    assert keys(s.next_batch()) == [("small", 0)]


def test_oversized_item_behind_others_is_taken_alone():
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=8, max_skips=1)
    s.add(item("a", 0, 50))
    s.add(item("big", 0, 1000))
    s.add(item("b", 0, 50))
    assert [keys(b) for b in drain(s)] == [[("a", 0), ("b", 0)], [("big", 0)]]


def test_exact_budget_fill():
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=8)
    for i in range(4):
        s.add(item("r", i, 50))
    assert [len(b) for b in drain(s)] == [2, 2]


# --- replace, cancel, bookkeeping -------------------------------------------


def test_replace_keeps_arrival_position_and_updates_cost():
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=1)
    s.add(item("a", 0, 10))
    s.add(item("b", 0, 20))
    s.add(item("a", 0, 70))
    assert s.pending_size() == 2 and s.pending_cost() == 90
    first = s.next_batch()
    assert first == [item("a", 0, 70)]
    assert s.next_batch() == [item("b", 0, 20)]
    assert s.next_batch() == []


def test_readding_after_taken_is_a_new_arrival():
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=1)
    s.add(item("a", 0, 10))
    assert keys(s.next_batch()) == [("a", 0)]
    s.add(item("b", 0, 10))
    s.add(item("a", 0, 10))
    assert [keys(b) for b in drain(s)] == [[("b", 0)], [("a", 0)]]


def test_cancel_removes_every_item_of_the_request():
    s = EncodeScheduler(max_batch_cost=1000, max_batch_items=64)
    for i in range(3):
        s.add(item("x", i, 10))
    s.add(item("y", 0, 5))
    s.add(item("x", 1, 30))  # replacement: still one item
    assert ("x", 1) in s and ("y", 0) in s and ("x", 9) not in s
    assert s.cancel("x") == 3
    assert s.cancel("x") == 0
    assert ("x", 0) not in s
    assert s.pending_size() == 1 and s.pending_cost() == 5
    assert s.next_batch() == [item("y", 0, 5)]


def test_cancel_after_partial_take_counts_only_pending():
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=2)
    for i in range(5):
        s.add(item("x", i, 10))
    assert len(s.next_batch()) == 2
    assert s.cancel("x") == 3
    assert s.pending_size() == 0 and s.pending_cost() == 0


def test_taken_and_cancelled_requests_leave_no_bookkeeping():
    s = EncodeScheduler(max_batch_cost=1000, max_batch_items=8)

    def cycle(start):
        for r in range(start, start + 5000):
            s.add(item(f"request-{r:08d}", 0, 10))
            s.add(item(f"request-{r:08d}", 1, 10))
            if r % 2:
                s.cancel(f"request-{r:08d}")
            else:
                drain(s)

    cycle(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cycle(5000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert s.pending_size() == 0
    assert grown < 50_000  # a leak of one entry per request would be > 500 kB


def _best_time(fn, reps=300):
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _loaded(n):
    s = EncodeScheduler(max_batch_cost=16384, max_batch_items=64)
    for i in range(n):
        s.add(item(f"bg{i}", 0, 64 + (i * 37) % 4000))
    return s


def test_cancel_and_next_batch_do_not_scale_with_pending():
    small, large = _loaded(1_000), _loaded(100_000)

    def cancel_cycle(s):
        def run():
            s.add(item("victim", 0, 100))
            s.add(item("victim", 1, 100))
            assert s.cancel("victim") == 2

        return run

    def batch_cycle(s):
        def run():
            batch = s.next_batch()
            for it in batch:  # put the work back at the tail: P stays constant
                s.add(it)

        return run

    # An O(P) scan would make the 100k case ~100x slower; allow 10x for noise.
    for cycle in (cancel_cycle, batch_cycle):
        t_small, t_large = _best_time(cycle(small)), _best_time(cycle(large))
        assert t_large < 10 * t_small + 20e-6, (cycle.__name__, t_small, t_large)


# --- max wait ----------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_max_wait_holds_an_underfull_batch_until_the_oldest_waited():
    clock = FakeClock()
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=4, max_wait_s=0.5, clock=clock)
    s.add(item("a", 0, 10))
    clock.t = 0.3
    s.add(item("b", 0, 10))
    assert s.time_until_ready() == pytest.approx(0.2)
    assert s.next_batch() == []
    assert s.pending_size() == 2 and s.pending_cost() == 20
    clock.t = 0.5
    assert s.time_until_ready() == 0.0
    assert keys(s.next_batch()) == [("a", 0), ("b", 0)]
    assert s.time_until_ready() is None


def test_max_wait_explicit_now_overrides_the_clock():
    def broken_clock():
        raise AssertionError("clock must not be read when now is given")

    s = EncodeScheduler(100, 4, max_wait_s=1.0, clock=broken_clock)
    s.add(item("a", 0, 10), now=10.0)
    assert s.time_until_ready(10.25) == pytest.approx(0.75)
    assert s.next_batch(10.5) == []
    assert keys(s.next_batch(11.0)) == [("a", 0)]


@pytest.mark.parametrize("fill", ["cost", "cap", "oversized"])
def test_max_wait_sends_a_full_batch_at_once(fill):
    s = EncodeScheduler(100, 4, max_wait_s=10.0, clock=FakeClock())
    if fill == "cost":
        s.add(item("a", 0, 60))
        s.add(item("b", 0, 40))
    elif fill == "cap":
        for i in range(4):
            s.add(item("a", i, 1))
    else:
        s.add(item("a", 0, 500))
    assert s.time_until_ready() == 0.0
    assert s.next_batch() != []


def test_max_wait_sends_when_more_is_pending_than_fits():
    s = EncodeScheduler(100, 4, max_wait_s=10.0, clock=FakeClock())
    s.add(item("a", 0, 70))
    s.add(item("b", 0, 70))
    assert keys(s.next_batch()) == [("a", 0)]
    assert s.next_batch() == []  # b alone is under-full and young


def test_replacement_keeps_arrival_time_for_max_wait():
    clock = FakeClock()
    s = EncodeScheduler(100, 4, max_wait_s=1.0, clock=clock)
    s.add(item("a", 0, 10))
    clock.t = 0.9
    s.add(item("a", 0, 20))
    assert s.time_until_ready() == pytest.approx(0.1)


def test_default_never_reads_the_clock():
    def broken_clock():
        raise AssertionError("max_wait_s=0 must not read the clock")

    s = EncodeScheduler(100, 4, clock=broken_clock)
    s.add(item("a", 0, 10))
    assert s.time_until_ready() == 0.0
    assert keys(s.next_batch()) == [("a", 0)]


# --- starvation ---------------------------------------------------------------


def test_late_sorting_ids_are_not_starved_by_a_stream_of_early_ones():
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=2)
    s.add(item("zzz", 0, 50))
    for i in range(20):
        s.add(item(f"a{i:03d}", 0, 50))
        s.add(item(f"a{i:03d}", 1, 50))
    assert ("zzz", 0) in keys(s.next_batch())


def _passes_of_big_item(max_skips):
    """Six 9000-cost items ahead of an 8000 one; 100-cost work keeps arriving."""
    s = EncodeScheduler(max_batch_cost=16384, max_batch_items=64, max_skips=max_skips)
    for i in range(6):
        s.add(item(f"old{i}", 0, 9000))
    s.add(item("big", 0, 8000))
    passes, t = 0, 0
    while ("big", 0) in s:
        s.add(item(f"small{t}", 0, 100))
        t += 1
        batch = keys(s.next_batch())
        if ("big", 0) not in batch and any(k[0].startswith("small") for k in batch):
            passes += 1
    return passes


def test_a_big_item_is_passed_over_at_most_max_skips_times():
    assert _passes_of_big_item(max_skips=2) == 2
    # Without the cap it is passed over in every batch until it is the oldest.
    assert _passes_of_big_item(max_skips=10**6) == 6
