# SPDX-License-Identifier: Apache-2.0
"""Random interleavings of submit, step, cancel, fail and executor failure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_encoder import EmbeddingCache, EncodeScheduler
from epd_encoder.engine.reference_scheduler import ReferenceScheduler
from epd_encoder.engine.worker import EncodeRequest, EncodeWorker, WorkItem
from epd_encoder.errors import EncoderError, RequestTimeout, UndecodableImage
from tests.engine.fakes import FakeExecutor, RecordingDeliverer, key_of

names = st.sampled_from([f"img{i}" for i in range(6)])
poisonable = st.sampled_from([f"img{i}" for i in range(6)] + [f"img{i}#{j}" for i in range(6) for j in range(3)])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.lists(st.tuples(names, st.integers(1, 40),
                                                        st.integers(0, 9), st.integers(0, 3)), max_size=4)),
        st.tuples(st.just("step")),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("timeout"), st.integers(0, 30)),
        st.tuples(st.just("boom")),
        st.tuples(st.just("poison"), poisonable),
        st.tuples(st.just("evict")),
    ),
    max_size=60,
)


@pytest.mark.parametrize("policy", ["lookahead+coalesce", "lookahead", "reference"])
@settings(max_examples=150, deadline=None)
@given(ops, st.integers(16, 120), st.integers(1, 4), st.sampled_from([64, 200, 1 << 20]))
def test_every_accepted_request_ends_exactly_once_with_chunked_items_too(policy, program, budget, cap, capacity):
    ex, dl = FakeExecutor(), RecordingDeliverer(release_immediately=False)
    cache = EmbeddingCache(capacity_bytes=capacity)
    sched = (ReferenceScheduler(max_batch_cost=budget, max_batch_items=cap) if policy == "reference"
             else EncodeScheduler(max_batch_cost=budget, max_batch_items=cap))
    w = EncodeWorker(executor=ex, scheduler=sched, cache=cache, deliverer=dl, max_pending_cost=150,
                     coalesce=policy == "lookahead+coalesce")
    accepted: dict[str, int] = {}
    n = released = 0
    for op in program:
        if op[0] == "submit":
            rid = f"r{n}"
            n += 1
            # A key is always chunked the same way (its parts follow from its content).
            items = tuple(
                WorkItem(key_of(name), cost, name,
                         UndecodableImage("corrupt") if bad == 0 else None,
                         parts=tuple((f"{name}#{j}", cost) for j in range(int(name[3:]) % 3 + 1))
                         if parts else ())
                for name, cost, bad, parts in op[1]
            )
            try:
                w.submit(EncodeRequest(rid, items))
            except EncoderError:
                continue
            accepted[rid] = len(items)
        elif op[0] == "step":
            w.step()
        elif op[0] == "cancel":
            w.cancel(f"r{op[1]}")
        elif op[0] == "timeout":
            w.fail(f"r{op[1]}", RequestTimeout("deadline"))
        elif op[0] == "boom":
            ex.fail_next = 1
        elif op[0] == "poison":
            ex.bad_payloads.symmetric_difference_update({op[1]})
        elif op[0] == "evict":  # consumers finish with their outputs
            for r in dl.items[released:]:
                r.release()
            released = len(dl.items)
    ex.bad_payloads.clear()
    while w.pending_size():
        w.step()

    assert w.active_requests == 0
    assert set(dl.finish_calls) == set(accepted)
    assert all(c == 1 for c in dl.finish_calls.values())
    assert not dl.after_finish
    for rid, outcome in dl.outcomes.items():
        if outcome.state == "done":
            got = sorted(r.item_index for r in dl.items if r.request_id == rid)
            assert got == list(range(accepted[rid]))
        else:
            assert isinstance(outcome.error, EncoderError)
    for r in dl.items[released:]:
        r.release()
    assert cache.stats.pinned == 0
    assert cache.current_bytes <= capacity
    if policy != "lookahead+coalesce":
        assert w.coalesced_total == 0
        assert not any(r.cache == "coalesced" for r in dl.items)
