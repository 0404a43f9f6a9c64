# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import random

import pytest

from epd_encoder.engine.reference_scheduler import ReferenceScheduler
from epd_encoder.engine.scheduler import EncodeScheduler, PendingEncodeItem


def item(rid: str, index: int = 0, cost: int = 10) -> PendingEncodeItem:
    return PendingEncodeItem(rid, index, cost)


def keys(batch):
    return [(i.request_id, i.item_index) for i in batch]


@pytest.mark.parametrize("kwargs", [{"max_batch_cost": 0}, {"max_batch_items": 0}])
def test_rejects_non_positive_limits(kwargs):
    with pytest.raises(ValueError):
        ReferenceScheduler(**kwargs)


def test_batches_in_id_order_not_arrival_order():
    s = ReferenceScheduler(max_batch_cost=1000, max_batch_items=3)
    for rid, index in [("c", 0), ("a", 1), ("b", 0), ("a", 0)]:
        s.add(item(rid, index))
    assert keys(s.next_batch()) == [("a", 0), ("a", 1), ("b", 0)]
    assert keys(s.next_batch()) == [("c", 0)]
    assert s.next_batch() == []


def test_stops_at_the_first_item_that_does_not_fit():
    s = ReferenceScheduler(max_batch_cost=100, max_batch_items=8)
    s.add(item("a", cost=60))
    s.add(item("b", cost=50))  # does not fit after a
    s.add(item("c", cost=10))  # would fit, but there is no look-ahead past b
    assert keys(s.next_batch()) == [("a", 0)]
    assert keys(s.next_batch()) == [("b", 0), ("c", 0)]


def test_lookahead_scheduler_would_have_filled_the_same_batch():
    # The contrast the baseline exists for: same items, EncodeScheduler looks past b.
    s = EncodeScheduler(max_batch_cost=100, max_batch_items=8)
    for rid, cost in [("a", 60), ("b", 50), ("c", 10)]:
        s.add(item(rid, cost=cost))
    assert keys(s.next_batch()) == [("a", 0), ("c", 0)]


def test_first_item_is_taken_alone_when_over_budget():
    s = ReferenceScheduler(max_batch_cost=100, max_batch_items=8)
    s.add(item("a", cost=500))
    s.add(item("b", cost=1))
    assert keys(s.next_batch()) == [("a", 0)]
    assert s.pending_cost() == 1


def test_item_cap_and_budget_are_respected():
    s = ReferenceScheduler(max_batch_cost=35, max_batch_items=2)
    for i in range(5):
        s.add(item(f"r{i}", cost=10))
    assert len(s.next_batch()) == 2  # the cap
    s2 = ReferenceScheduler(max_batch_cost=35, max_batch_items=8)
    for i in range(5):
        s2.add(item(f"r{i}", cost=10))
    assert sum(i.cost for i in s2.next_batch()) == 30  # the budget


def test_readd_replaces_and_pending_cost_tracks_it():
    s = ReferenceScheduler(max_batch_cost=100, max_batch_items=8)
    s.add(item("a", cost=10))
    s.add(item("a", cost=30))
    assert s.pending_size() == 1 and s.pending_cost() == 30
    assert s.next_batch()[0].cost == 30
    assert s.pending_size() == 0 and s.pending_cost() == 0


def test_cancel_removes_every_item_of_the_request_only():
    s = ReferenceScheduler(max_batch_cost=1000, max_batch_items=8)
    for index in range(3):
        s.add(item("a", index))
    s.add(item("b"))
    assert s.cancel("a") == 3
    assert s.cancel("a") == 0
    assert ("a", 0) not in s and ("b", 0) in s
    assert s.pending_cost() == 10
    assert keys(s.next_batch()) == [("b", 0)]


def test_time_until_ready_never_holds_a_batch():
    s = ReferenceScheduler()
    assert s.time_until_ready() is None
    s.add(item("a"))
    assert s.time_until_ready() == 0.0


def test_peek_batch_changes_nothing_and_matches_next_batch():
    s = ReferenceScheduler(max_batch_cost=50, max_batch_items=3)
    for i in range(6):
        s.add(item(f"r{5 - i}", cost=10 + i))
    before = (s.pending_size(), s.pending_cost())
    peeked = s.peek_batch()
    assert s.peek_batch() == peeked
    assert (s.pending_size(), s.pending_cost()) == before
    assert s.next_batch() == peeked


def test_batches_depend_on_the_pending_set_not_on_arrival_order():
    items = [item(f"r{i % 7}", i, cost=1 + (i * 37) % 40) for i in range(30)]
    runs = []
    for seed in range(3):
        shuffled = items[:]
        random.Random(seed).shuffle(shuffled)
        s = ReferenceScheduler(max_batch_cost=64, max_batch_items=4)
        for it in shuffled:
            s.add(it)
        batches = []
        while s.pending_size():
            batches.append(keys(s.next_batch()))
        runs.append(batches)
    assert runs[0] == runs[1] == runs[2]


def test_an_item_with_a_late_id_starves_while_smaller_ids_keep_arriving():
    # Not starvation-free by design: EncodeScheduler serves "z" in the first batch.
    s = ReferenceScheduler(max_batch_cost=20, max_batch_items=8)
    s.add(item("z", cost=10))
    for step in range(50):
        s.add(item(f"a{step:03d}", 0, cost=10))
        s.add(item(f"a{step:03d}", 1, cost=10))
        assert ("z", 0) not in keys(s.next_batch())
    assert ("z", 0) in s
