# SPDX-License-Identifier: Apache-2.0
"""Items encoded in parts (a long video in chunks of whole temporal groups)."""

from __future__ import annotations

import torch

from epd_encoder import EmbeddingCache, EncodeScheduler
from epd_encoder.engine.worker import EncodeRequest, EncodeWorker, WorkItem
from epd_encoder.errors import EncodeFailed
from epd_encoder.types import ItemOutput
from tests.engine.fakes import FakeExecutor, RecordingDeliverer, key_of, output_for


def make(max_batch_cost=100, max_batch_items=8):
    ex, dl = FakeExecutor(), RecordingDeliverer()
    sched = EncodeScheduler(max_batch_cost=max_batch_cost, max_batch_items=max_batch_items)
    w = EncodeWorker(executor=ex, scheduler=sched, cache=EmbeddingCache(capacity_bytes=1 << 20), deliverer=dl)
    return w, ex, dl, sched


def chunked(name: str, n: int, cost: int = 100) -> WorkItem:
    parts = tuple((f"{name}#{j}", cost) for j in range(n))
    return WorkItem(key_of(name), cost * n, name, parts=parts)


def test_parts_are_scheduled_apart_and_reassembled_in_order():
    w, ex, dl, _ = make()
    w.submit(EncodeRequest("r", (chunked("video", 3),)))
    steps = 0
    while w.pending_size():
        w.step()
        steps += 1
    assert steps == 3 and [c for c in ex.calls] == [["video#0"], ["video#1"], ["video#2"]]
    (item,) = dl.items_of("r")
    want = torch.cat([output_for(f"video#{j}").embedding for j in range(3)])
    assert torch.equal(item.output.embedding, want)
    assert dl.outcomes["r"].state == "done" and item.cache == "miss"


def test_deepstack_parts_concatenate_per_layer():
    class Deep(FakeExecutor):
        def encode(self, payloads):
            return [ItemOutput(torch.full((2, 3), float(i)), (torch.full((2, 3), 10.0 + i),))
                    for i in (int(p[-1]) for p in payloads)]

    ex, dl = Deep(), RecordingDeliverer()
    w = EncodeWorker(executor=ex, scheduler=EncodeScheduler(max_batch_cost=100, max_batch_items=8),
                     cache=EmbeddingCache(capacity_bytes=1 << 20), deliverer=dl)
    w.submit(EncodeRequest("r", (chunked("v", 2),)))
    while w.pending_size():
        w.step()
    out = dl.items_of("r")[0].output
    assert out.embedding[:, 0].tolist() == [0, 0, 1, 1]
    assert out.deepstack[0][:, 0].tolist() == [10, 10, 11, 11]


def test_a_duplicate_of_a_chunked_item_coalesces_and_the_whole_is_cached():
    w, ex, dl, _ = make()
    w.submit(EncodeRequest("a", (chunked("v", 2),)))
    w.step()  # part 0 done; part 1 still queued
    w.submit(EncodeRequest("b", (chunked("v", 2),)))
    while w.pending_size():
        w.step()
    assert sum(ex.encoded.values()) == 2
    assert dl.items_of("b")[0].cache == "coalesced"
    w.submit(EncodeRequest("c", (chunked("v", 2),)))
    assert dl.items_of("c")[0].cache == "hit"
    assert torch.equal(dl.items_of("c")[0].output.embedding, dl.items_of("a")[0].output.embedding)


def test_cancel_between_parts_unschedules_the_rest():
    w, ex, dl, sched = make()
    w.submit(EncodeRequest("r", (chunked("v", 3),)))
    w.step()
    assert w.cancel("r")
    assert sched.pending_size() == 0 and sched.pending_cost() == 0
    assert w.step() == 0 and ex.calls == [["v#0"]]
    assert dl.outcomes["r"].state == "cancelled" and dl.items_of("r") == []
    # The key is free again: a new request encodes it from the start.
    w.submit(EncodeRequest("again", (chunked("v", 3),)))
    while w.pending_size():
        w.step()
    assert dl.outcomes["again"].state == "done" and len(ex.calls) == 4


def test_a_failed_part_fails_the_item_once_and_unschedules_the_rest():
    w, ex, dl, sched = make(max_batch_cost=200)
    ex.bad_payloads.add("v#1")
    w.submit(EncodeRequest("r", (chunked("v", 4),)))
    w.submit(EncodeRequest("other", (WorkItem(key_of("img"), 10, "img"),)))
    while w.pending_size():
        w.step()
    assert dl.outcomes["r"].state == "failed" and dl.finish_calls["r"] == 1
    assert ["v#2"] not in ex.calls and ["v#3"] not in ex.calls
    assert dl.outcomes["other"].state == "done"
    assert sched.pending_cost() == 0


def test_a_failed_batch_fails_a_chunked_item_and_the_worker_keeps_serving():
    w, ex, dl, sched = make()
    w.submit(EncodeRequest("r", (chunked("v", 2),)))
    ex.fail_next = 1
    assert w.step() == 0
    assert isinstance(dl.outcomes["r"].error, EncodeFailed)
    assert sched.pending_size() == 0
    w.submit(EncodeRequest("s", (chunked("v", 2),)))
    while w.pending_size():
        w.step()
    assert dl.outcomes["s"].state == "done"


def test_small_parts_share_a_batch_and_keep_their_order():
    w, ex, dl, _ = make(max_batch_cost=250)
    w.submit(EncodeRequest("r", (chunked("v", 3, cost=100),)))
    while w.pending_size():
        w.step()
    assert ex.calls == [["v#0", "v#1"], ["v#2"]]
    want = torch.cat([output_for(f"v#{j}").embedding for j in range(3)])
    assert torch.equal(dl.items_of("r")[0].output.embedding, want)
