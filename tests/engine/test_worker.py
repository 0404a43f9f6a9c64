# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest
import torch

from epd_encoder import EmbeddingCache, EncodeScheduler
from epd_encoder.engine.worker import EncodeRequest, EncodeWorker, WorkItem
from epd_encoder.errors import (
    Cancelled,
    DuplicateRequest,
    EncodeFailed,
    Overloaded,
    RequestTimeout,
    UndecodableImage,
)
from tests.engine.fakes import FakeExecutor, RecordingDeliverer, key_of, output_for


def make(max_batch_cost=1000, max_batch_items=8, capacity=1 << 20, max_pending_cost=None,
         release_immediately=True, coalesce=True):
    ex, dl = FakeExecutor(), RecordingDeliverer(release_immediately)
    cache = EmbeddingCache(capacity_bytes=capacity)
    sched = EncodeScheduler(max_batch_cost=max_batch_cost, max_batch_items=max_batch_items)
    w = EncodeWorker(executor=ex, scheduler=sched, cache=cache, deliverer=dl,
                     max_pending_cost=max_pending_cost, coalesce=coalesce)
    return w, ex, dl, cache


def req(rid, *names, cost=10):
    return EncodeRequest(rid, tuple(WorkItem(key_of(n), cost, n) for n in names))


def drain(w):
    while w.pending_size():
        w.step()


def test_miss_then_hit_skips_the_tower():
    w, ex, dl, cache = make()
    w.submit(req("a", "x", "y"))
    assert w.step() == 2
    assert [r.cache for r in dl.items_of("a")] == ["miss", "miss"]
    assert dl.outcomes["a"].state == "done"
    w.submit(req("b", "y"))
    assert dl.outcomes["b"].state == "done"  # delivered inside submit
    assert len(ex.calls) == 1 and dl.items_of("b")[0].cache == "hit"
    assert torch.equal(dl.items_of("b")[0].output.embedding, output_for("y").embedding)


def test_concurrent_duplicates_encode_once_and_all_get_the_result():
    w, ex, dl, _ = make()
    for i in range(5):
        w.submit(req(f"r{i}", "same", f"own{i}"))
    w.submit(req("twice", "same", "same"))
    drain(w)
    assert ex.encoded["same"] == 1
    states = sorted(r.cache for r in dl.items if r.key == key_of("same"))
    assert states == ["coalesced"] * 6 + ["miss"]
    assert w.coalesced_total == 6
    assert all(o.state == "done" for o in dl.outcomes.values())


def test_failed_encode_fails_every_waiter_with_the_same_reason():
    w, ex, dl, _ = make()
    for i in range(3):
        w.submit(req(f"r{i}", "k"))
    ex.fail_next = 1
    assert w.step() == 0
    errors = {id(dl.outcomes[f"r{i}"].error) for i in range(3)}
    assert len(errors) == 1
    err = dl.outcomes["r0"].error
    assert isinstance(err, EncodeFailed) and "out of memory" in str(err)
    # The worker keeps serving; the key is encodable again.
    w.submit(req("later", "k"))
    drain(w)
    assert dl.outcomes["later"].state == "done"


def test_executor_error_fails_only_its_batch():
    w, ex, dl, _ = make(max_batch_items=1)
    w.submit(req("first", "a"))
    w.submit(req("second", "b"))
    ex.fail_next = 1
    drain(w)
    assert dl.outcomes["first"].state == "failed"
    assert dl.outcomes["second"].state == "done"


def test_per_item_error_fails_only_that_items_requests():
    w, ex, dl, _ = make()
    ex.bad_payloads.add("poison")
    w.submit(req("p", "poison", "fine1"))
    w.submit(req("q", "fine1", "fine2"))
    drain(w)
    assert dl.outcomes["p"].state == "failed" and "poison" in str(dl.outcomes["p"].error)
    assert dl.outcomes["q"].state == "done"


def test_bad_item_fails_its_own_request_only():
    w, ex, dl, _ = make()
    bad = EncodeRequest("bad", (WorkItem(key_of("ok"), 10, "ok"),
                                WorkItem(key_of("?"), 0, None, UndecodableImage("not an image"))))
    w.submit(bad)
    w.submit(req("good", "ok"))
    drain(w)
    assert isinstance(dl.outcomes["bad"].error, UndecodableImage)
    assert dl.outcomes["good"].state == "done" and ex.encoded["ok"] == 1


def test_cancel_keeps_shared_flights_and_unschedules_orphans():
    w, ex, dl, _ = make()
    w.submit(req("a", "shared", "only_a"))
    w.submit(req("b", "shared"))
    assert w.pending_size() == 2
    assert w.cancel("a") is True
    assert w.pending_size() == 1 and isinstance(dl.outcomes["a"].error, Cancelled)
    assert dl.outcomes["a"].state == "cancelled"
    drain(w)
    assert ex.encoded == {"shared": 1}
    assert dl.outcomes["b"].state == "done"
    assert w.cancel("a") is False and dl.finish_calls["a"] == 1


def test_fail_with_timeout_reason():
    w, _, dl, _ = make()
    w.submit(req("slow", "x"))
    assert w.fail("slow", RequestTimeout("deadline passed"))
    assert dl.outcomes["slow"].state == "failed"
    assert isinstance(dl.outcomes["slow"].error, RequestTimeout)
    assert w.pending_size() == 0


def test_overload_rejects_without_accepting():
    w, _, dl, _ = make(max_pending_cost=25)
    w.submit(req("a", "x", "y"))  # 20 pending
    with pytest.raises(Overloaded):
        w.submit(req("b", "z"))  # 20 + 10 > 25
    assert "b" not in dl.outcomes and not w.is_active("b")
    w.submit(req("c", "x"))  # attaches to a flight: costs nothing more
    drain(w)
    w.submit(req("huge", "h1", "h2", "h3", cost=100))  # an empty queue always admits
    assert w.is_active("huge")


def test_duplicate_request_id_is_rejected():
    w, *_ = make()
    w.submit(req("dup", "x"))
    with pytest.raises(DuplicateRequest):
        w.submit(req("dup", "y"))
    assert w.pending_size() == 1


def test_delivery_failure_fails_that_request_and_unpins():
    w, _, dl, cache = make(release_immediately=False)
    dl.raise_for.add("gone")
    w.submit(req("gone", "x"))
    w.submit(req("here", "x"))
    drain(w)
    assert dl.outcomes["gone"].state == "failed"
    assert dl.outcomes["here"].state == "done"
    dl.items_of("here")[0].release()
    assert cache.stats.pinned == 0


def test_delivered_entries_stay_pinned_until_released():
    # Room for exactly one 32-byte output (2x4 fp32).
    w, _, dl, cache = make(capacity=40, release_immediately=False)
    w.submit(req("a", "x"))
    drain(w)
    w.submit(req("b", "y"))
    drain(w)
    assert key_of("x") in cache and key_of("y") not in cache  # x pinned: y not stored
    dl.items_of("a")[0].release()
    w.submit(req("c", "z"))
    drain(w)
    assert key_of("z") in cache and key_of("x") not in cache


class ExplodingCache(EmbeddingCache):
    """A cache whose device copies fail (say, out of memory) on demand."""

    def __init__(self):
        super().__init__(capacity_bytes=1 << 20)
        self.boom = set()

    def acquire(self, key):
        if "acquire" in self.boom:
            raise RuntimeError("CUDA out of memory (fake promote)")
        return super().acquire(key)

    def put(self, key, value, nbytes):
        if "put" in self.boom:
            raise RuntimeError("CUDA out of memory (fake put)")
        return super().put(key, value, nbytes)


def test_a_raising_cache_degrades_to_misses_and_unstored_outputs():
    ex, dl, cache = FakeExecutor(), RecordingDeliverer(), ExplodingCache()
    w = EncodeWorker(executor=ex, scheduler=EncodeScheduler(max_batch_cost=100, max_batch_items=4),
                     cache=cache, deliverer=dl)
    cache.boom = {"put"}
    w.submit(req("a", "x"))
    drain(w)
    assert dl.outcomes["a"].state == "done" and key_of("x") not in cache
    cache.boom = {"acquire"}
    w.submit(req("b", "x"))
    drain(w)
    assert dl.outcomes["b"].state == "done" and ex.encoded["x"] == 2


def test_fail_all_ends_every_active_request_once():
    w, _, dl, _ = make()
    for i in range(3):
        w.submit(req(f"r{i}", "shared", f"own{i}"))
    assert w.fail_all(EncodeFailed("engine error")) == 3
    assert w.pending_size() == 0 and w.active_requests == 0
    assert all(dl.finish_calls[f"r{i}"] == 1 for i in range(3))


# -- coalesce=False: the reference baseline's policy ------------------------------


def test_without_coalescing_each_concurrent_duplicate_is_encoded():
    w, ex, dl, cache = make(coalesce=False, release_immediately=False)
    for i in range(3):
        w.submit(req(f"r{i}", "same"))
    w.submit(req("twice", "same", "same"))
    assert w.pending_size() == 5
    drain(w)
    assert ex.encoded["same"] == 5
    assert sorted(r.cache for r in dl.items) == ["miss"] * 5
    assert w.coalesced_total == 0
    assert all(torch.equal(r.output.embedding, output_for("same").embedding) for r in dl.items)
    assert all(o.state == "done" for o in dl.outcomes.values())
    for r in dl.items:
        r.release()
    assert cache.stats.pinned == 0


def test_without_coalescing_cache_hits_still_skip_the_tower():
    w, ex, dl, _ = make(coalesce=False)
    w.submit(req("a", "x"))
    drain(w)
    w.submit(req("b", "x"))
    assert dl.items_of("b")[0].cache == "hit" and ex.encoded["x"] == 1


def test_without_coalescing_cancel_unschedules_only_that_requests_copy():
    w, ex, dl, _ = make(coalesce=False)
    w.submit(req("a", "same"))
    w.submit(req("b", "same"))
    assert w.cancel("a")
    assert w.pending_size() == 1
    drain(w)
    assert dl.outcomes["a"].state == "cancelled" and dl.outcomes["b"].state == "done"
    assert ex.encoded["same"] == 1 and dl.items_of("b")[0].cache == "miss"


def test_without_coalescing_a_failed_copy_fails_only_its_request():
    w, ex, dl, _ = make(coalesce=False, max_batch_items=1)
    w.submit(req("a", "same"))
    w.submit(req("b", "same"))
    ex.fail_next = 1
    drain(w)
    assert dl.outcomes["a"].state == "failed"
    assert dl.outcomes["b"].state == "done"


def test_without_coalescing_admission_charges_every_duplicate():
    w, _, _, _ = make(coalesce=False, max_pending_cost=25)
    w.submit(req("a", "same", cost=10))
    w.submit(req("b", "same", cost=10))  # 20 <= 25
    with pytest.raises(Overloaded):
        w.submit(req("c", "same", cost=10))  # a coalescing worker would admit it free


def test_a_ready_output_is_delivered_as_a_hit_stored_and_never_encoded():
    # A shared-tier (L3) hit: the front already holds the output, so the tower never sees it,
    # not even when the key is in flight, and the queue is not charged for it.
    w, ex, dl, cache = make(max_pending_cost=15)
    w.submit(req("busy", "x"))  # x is queued (cost 10 of 15)
    ready = output_for("from-l3")
    items = (WorkItem(key_of("x"), 10, "x", ready=ready), WorkItem(key_of("y"), 10, "y", ready=ready))
    w.submit(EncodeRequest("shared", items))  # 10 + 20 > 15, but ready items cost nothing
    assert dl.outcomes["shared"].state == "done"  # inside submit
    assert [r.cache for r in dl.items_of("shared")] == ["hit", "hit"]
    assert all(r.output is ready for r in dl.items_of("shared"))
    assert cache.get(key_of("y")) is ready  # promoted into the cache
    drain(w)
    assert ex.encoded.get("y", 0) == 0 and ex.encoded["x"] == 1
