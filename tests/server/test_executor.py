# SPDX-License-Identifier: Apache-2.0
"""ServingExecutor: what it hands a tensor-parallel executor for the batch digest, and the
prefetch that finishes the next batch while a forward runs."""

from __future__ import annotations

import threading
import time

import torch

from epd_encoder.api.metrics import Metrics
from epd_encoder.errors import EncodeFailed, UndecodableImage
from epd_encoder.preprocess.base import StagedImage
from epd_encoder.server.executor import PartSource, PixelSource, ServingExecutor
from epd_encoder.types import ItemOutput, PreprocessedImage


class RecordingTP:
    """The TP executors' signature: ``encode(items, *, keys, costs)``."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def encode(self, items, *, keys=None, costs=None):
        self.calls.append({"grids": [it.grid_thw for it in items], "keys": keys, "costs": costs})
        return [ItemOutput(torch.zeros(it.num_tokens, 4)) for it in items]


def finish(staged: StagedImage, device=None) -> PreprocessedImage:
    return PreprocessedImage(staged.pixels.float().reshape(staged.pixels.shape[0], -1), staged.grid_thw,
                             staged.num_tokens)


def source(key: bytes, grid, cost: int) -> PixelSource:
    t, h, w = grid
    staged = StagedImage(torch.zeros(t * h * w, 3, 2, 2, dtype=torch.uint8), grid, t * h * w // 4)
    return PixelSource(staged, lambda: staged, cost, finish, key=key)


def test_the_digest_names_each_item_by_content_key_and_first_temporal_group():
    tp = RecordingTP()
    serving = ServingExecutor(tp, preprocessor=None, metrics=Metrics(), max_batch_cost=1000)
    image, video = source(b"\x01" * 32, (1, 4, 4), 16), source(b"\x02" * 32, (6, 2, 2), 24)
    out = serving.encode([image, PartSource(video, 2, 4, 8), PartSource(video, 4, 6, 8)])
    assert all(isinstance(o, ItemOutput) for o in out)
    (call,) = tp.calls
    assert call["keys"] == [("01" * 32, 0), ("02" * 32, 2), ("02" * 32, 4)]
    assert call["costs"] == [16, 8, 8] and call["grids"] == [(1, 4, 4), (2, 2, 2), (2, 2, 2)]


# -- prefetch: the next batch's finish runs while this batch's forward runs --------------


class GatedTower:
    """A CPU executor whose forward can wait for an event (to prove an overlap)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.wait_for: threading.Event | None = None
        self.overlapped: list[bool] = []

    def encode(self, items):
        if self.wait_for is not None:
            self.overlapped.append(self.wait_for.wait(10))
        return [ItemOutput(it.pixel_values.sum(dim=1, keepdim=True)) for it in items]


class CountingFinish:
    def __init__(self) -> None:
        self.threads: dict[bytes, list[str]] = {}
        self.done: dict[bytes, threading.Event] = {}
        self.fail: dict[bytes, BaseException] = {}

    def __call__(self, key: bytes):
        def finish_(staged: StagedImage, device=None) -> PreprocessedImage:
            self.threads.setdefault(key, []).append(threading.current_thread().name)
            if key in self.fail:
                raise self.fail[key]
            out = finish(staged, device)
            self.done.setdefault(key, threading.Event()).set()
            return out
        return finish_


def make_sources(counting: CountingFinish, *names: str) -> dict[str, PixelSource]:
    out = {}
    for n, name in enumerate(names):
        key = name.encode()
        staged = StagedImage(torch.full((4, 3, 2, 2), n, dtype=torch.uint8), (1, 2, 2), 1)
        out[name] = PixelSource(staged, lambda s=staged: s, 4, counting(key), key=key)
    return out


def serving_over(tower, prefetch: bool = True) -> ServingExecutor:
    return ServingExecutor(tower, preprocessor=None, metrics=Metrics(), max_batch_cost=1000, prefetch=prefetch)


def test_the_previewed_batch_is_finished_during_the_running_forward():
    tower, counting = GatedTower(), CountingFinish()
    src = make_sources(counting, "a", "b", "c")
    serving = serving_over(tower)
    try:
        serving.prefetch([src["b"], src["c"]])
        # The forward of [a] returns only once b and c are finished: proof of the overlap.
        tower.wait_for = counting.done.setdefault(b"c", threading.Event())
        serving.encode([src["a"]])
        assert tower.overlapped == [True]
        tower.wait_for = None
        serving.encode([src["b"], src["c"]])
        assert serving.prefetched == 2
        assert counting.threads[b"a"] == ["MainThread"]
        assert counting.threads[b"b"] == counting.threads[b"c"] == ["epd-prefetch"]  # finished once
    finally:
        serving.drop_prefetch(stop=True)


def test_outputs_are_the_same_with_and_without_prefetch():
    results = []
    for prefetch in (True, False):
        counting = CountingFinish()
        src = make_sources(counting, "a", "b", "c", "d")
        serving = serving_over(GatedTower(), prefetch)
        serving.prefetch([src["b"], src["c"]])
        first = serving.encode([src["a"]])
        serving.prefetch([src["d"]])
        second = serving.encode([src["b"], src["c"]])
        third = serving.encode([src["d"]])
        serving.drop_prefetch(stop=True)
        assert serving.prefetched == (3 if prefetch else 0)
        results.append([o.embedding for o in first + second + third])
    assert all(torch.equal(x, y) for x, y in zip(*results))


def test_a_wrong_guess_is_finished_in_line_and_the_guess_dropped():
    tower, counting = GatedTower(), CountingFinish()
    src = make_sources(counting, "a", "b", "c")
    serving = serving_over(tower)
    try:
        serving.prefetch([src["b"]])
        serving.encode([src["a"]])
        out = serving.encode([src["c"]])  # b was cancelled meanwhile, say
        assert isinstance(out[0], ItemOutput) and serving.prefetched == 0
        assert counting.threads[b"c"] == ["MainThread"]
    finally:
        serving.drop_prefetch(stop=True)


def test_a_failed_prefetch_surfaces_as_that_items_error_only():
    tower, counting = GatedTower(), CountingFinish()
    src = make_sources(counting, "a", "bad", "typed", "ok")
    counting.fail = {b"bad": RuntimeError("corrupt pixels"), b"typed": UndecodableImage("typed failure")}
    serving = serving_over(tower)
    try:
        serving.prefetch([src["bad"], src["typed"], src["ok"]])
        serving.encode([src["a"]])
        bad, typed, ok = serving.encode([src["bad"], src["typed"], src["ok"]])
        assert isinstance(bad, EncodeFailed) and "preprocessing failed" in str(bad)
        assert isinstance(typed, UndecodableImage)
        assert isinstance(ok, ItemOutput) and serving.prefetched == 1
        assert counting.threads[b"bad"] == ["epd-prefetch"]  # not retried in line
    finally:
        serving.drop_prefetch(stop=True)


def test_drop_with_stop_leaves_no_thread_and_frees_the_prefetched_batch():
    tower, counting = GatedTower(), CountingFinish()
    src = make_sources(counting, "a", "b")
    serving = serving_over(tower)
    serving.prefetch([src["b"]])
    serving.encode([src["a"]])
    assert serving.prefetch_thread_alive
    serving.drop_prefetch(stop=True)
    assert not serving.prefetch_thread_alive
    serving.encode([src["b"]])  # the dropped work is done again, in line
    assert serving.prefetched == 0 and not serving.prefetch_thread_alive


def test_no_prefetch_on_a_device_until_it_has_a_side_stream():
    class OnDevice(GatedTower):
        device = torch.device("meta")

    counting = CountingFinish()
    src = make_sources(counting, "a", "b")
    serving = serving_over(OnDevice())
    serving.prefetch([src["b"]])
    serving.encode([src["a"]])
    assert not serving.prefetch_thread_alive and b"b" not in counting.threads


def test_on_a_device_only_the_staged_uint8_crosses_through_the_executors_upload():
    class OnDevice(GatedTower):
        device = torch.device("meta")

        def __init__(self) -> None:
            super().__init__()
            self.uploaded: list[torch.dtype] = []

        def upload(self, host):
            self.uploaded.append(host.dtype)
            return host  # stands in for the pinned side-stream copy (models/executor.py)

    seen: list[tuple[torch.dtype, object]] = []

    def finish_(staged, device=None):
        seen.append((staged.pixels.dtype, device))
        return finish(staged)

    tower = OnDevice()
    staged = StagedImage(torch.zeros(4, 3, 2, 2, dtype=torch.uint8), (1, 2, 2), 1)
    out = serving_over(tower).encode([PixelSource(staged, lambda: staged, 4, finish_, key=b"k")])
    assert isinstance(out[0], ItemOutput)
    assert tower.uploaded == [torch.uint8] and seen == [(torch.uint8, torch.device("meta"))]


def test_the_prefetched_batch_is_charged_until_its_forward_takes_it_or_it_is_dropped():
    from epd_encoder.server.budget import ByteBudget

    tower, counting, budget = GatedTower(), CountingFinish(), ByteBudget(1 << 20)
    src = make_sources(counting, "a", "b", "c", "d")
    serving = ServingExecutor(tower, preprocessor=None, metrics=Metrics(), max_batch_cost=1000, held=budget)
    per_item = 4 * 12 * 4  # finish: 4 rows of 12 float32
    try:
        serving.prefetch([src["b"], src["c"]])
        tower.wait_for = counting.done.setdefault(b"c", threading.Event())
        serving.encode([src["a"]])  # returns once b and c are finished on the side thread
        assert budget.held == 2 * per_item  # the prefetched batch waits, charged
        tower.wait_for = None
        serving.prefetch([src["d"]])
        serving.encode([src["b"], src["c"]])  # taken by its forward: no longer queued
        assert serving.prefetched == 2
        deadline = time.monotonic() + 10  # d is charged once its finish on the side thread ends
        while budget.held != per_item:
            assert time.monotonic() < deadline, budget.held
            time.sleep(0.005)
        serving.drop_prefetch()  # cancelled, say: nothing is pending any more
        assert budget.held == 0 and budget.peak == 2 * per_item
    finally:
        serving.drop_prefetch(stop=True)
