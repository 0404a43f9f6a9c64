# SPDX-License-Identifier: Apache-2.0
"""EncodeWorker with a prefetching executor: the preview it hands over, and when it drops it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_encoder import EmbeddingCache, EncodeScheduler
from epd_encoder.engine.loop import EngineLoop, FutureSink
from epd_encoder.engine.reference_scheduler import ReferenceScheduler
from epd_encoder.engine.worker import EncodeRequest, EncodeWorker, WorkItem
from tests.engine.fakes import FakeExecutor, RecordingDeliverer, key_of


class PrefetchingExecutor(FakeExecutor):
    def __init__(self, raise_on_prefetch: bool = False) -> None:
        super().__init__()
        self.previews: list[list] = []
        self.drops: list[bool] = []
        self.raise_on_prefetch = raise_on_prefetch

    def prefetch(self, payloads):
        self.previews.append(list(payloads))
        if self.raise_on_prefetch:
            raise RuntimeError("prefetch thread failed to start (fake)")

    def drop_prefetch(self, *, stop=False):
        self.drops.append(stop)


class NoPeek:
    """A scheduler without the optional ``peek_batch`` (say, a wrapper that lacks it)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def add(self, item):
        self._inner.add(item)

    def next_batch(self):
        return self._inner.next_batch()

    def cancel(self, request_id):
        return self._inner.cancel(request_id)

    def pending_size(self):
        return self._inner.pending_size()

    def pending_cost(self):
        return self._inner.pending_cost()


def make(scheduler=None, executor=None, coalesce=True):
    ex = executor or PrefetchingExecutor()
    dl = RecordingDeliverer()
    sched = scheduler or EncodeScheduler(max_batch_cost=100, max_batch_items=2)
    w = EncodeWorker(executor=ex, scheduler=sched, cache=EmbeddingCache(capacity_bytes=1 << 20), deliverer=dl,
                     coalesce=coalesce)
    return w, ex, dl


def req(rid, *names, cost=10):
    return EncodeRequest(rid, tuple(WorkItem(key_of(n), cost, n) for n in names))


def test_each_step_hands_over_the_next_batch_before_its_forward():
    w, ex, _ = make()
    w.submit(req("r", "a", "b", "c", "d", "e"))
    while w.pending_size():
        w.step()
    assert ex.calls == [["a", "b"], ["c", "d"], ["e"]]
    assert ex.previews == [["c", "d"], ["e"], []]  # each preview is the batch that followed


def test_previews_follow_the_reference_policy_too():
    w, ex, _ = make(ReferenceScheduler(max_batch_cost=100, max_batch_items=1), coalesce=False)
    w.submit(req("b", "x"))
    w.submit(req("a", "y"))
    w.step()
    assert ex.calls == [["y"]] and ex.previews == [["x"]]


def test_no_prefetch_without_peek_batch():
    w, ex, dl = make(NoPeek(EncodeScheduler(max_batch_cost=100, max_batch_items=1)))
    w.submit(req("r", "a", "b"))
    while w.pending_size():
        w.step()
    assert ex.previews == [] and ex.drops == [] and dl.outcomes["r"].state == "done"


def test_a_failing_prefetch_never_fails_the_batch():
    w, ex, dl = make(executor=PrefetchingExecutor(raise_on_prefetch=True))
    w.submit(req("r", "a", "b", "c"))
    while w.pending_size():
        w.step()
    assert dl.outcomes["r"].state == "done" and len(ex.previews) == 2


def test_prefetch_is_dropped_once_nothing_is_pending():
    w, ex, dl = make(EncodeScheduler(max_batch_cost=100, max_batch_items=1))
    w.submit(req("keep", "a"))
    w.submit(req("gone", "b"))
    w.step()  # encodes a, previews b
    assert ex.previews == [["b"]]
    ex.drops.clear()
    w.cancel("gone")
    assert ex.drops == [False]  # b was the prefetch's only item


def test_close_stops_the_prefetch_thread_and_engine_stop_closes():
    w, ex, _ = make()
    w.close()
    assert ex.drops == [True]
    ex = PrefetchingExecutor()
    loop = EngineLoop(lambda dl: EncodeWorker(executor=ex, scheduler=EncodeScheduler(100, 2),
                                              cache=EmbeddingCache(capacity_bytes=1 << 20), deliverer=dl))
    loop.start()
    sink = FutureSink()
    loop.submit(req("r", "a", "b", "c"), sink)
    assert sink.future.result(10).outcome.state == "done"
    loop.stop()
    assert ex.drops[-1] is True


names = st.sampled_from([f"img{i}" for i in range(8)])
program = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.lists(st.tuples(names, st.integers(1, 60)), min_size=1, max_size=4)),
    st.tuples(st.just("step")),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
), max_size=50)


@settings(max_examples=100, deadline=None)
@given(program, st.sampled_from(["lookahead", "reference"]))
def test_peeking_never_changes_which_batches_form(ops, policy):
    # Tensor-parallel ranks replay scheduler calls: a rank that previews must form the
    # same batches as one that does not.
    def run(executor):
        sched = (ReferenceScheduler(100, 3) if policy == "reference"
                 else EncodeScheduler(100, 3, lookahead=2, max_skips=2))
        w = EncodeWorker(executor=executor, scheduler=sched, cache=EmbeddingCache(capacity_bytes=1 << 20),
                         deliverer=RecordingDeliverer(), coalesce=policy != "reference")
        n = 0
        for op in ops:
            if op[0] == "submit":
                w.submit(EncodeRequest(f"r{n}", tuple(WorkItem(key_of(nm), c, f"{nm}/{c}") for nm, c in op[1])))
                n += 1
            elif op[0] == "step":
                w.step()
            else:
                w.cancel(f"r{op[1]}")
        while w.pending_size():
            w.step()
        return executor.calls

    peeking = PrefetchingExecutor()
    assert run(peeking) == run(FakeExecutor())
    assert peeking.previews or not peeking.calls
