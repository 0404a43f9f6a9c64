# SPDX-License-Identifier: Apache-2.0
"""Finish prefetch: the next batch's normalization on a side thread, overlapping the forward.

The engine of a real server (ServingExecutor over the VisionExecutor, EncodeWorker, EngineLoop,
built by engine/build.py) without HTTP or decoding: images are staged once up front, and
client threads submit single-image requests in a closed loop, each with a fresh content key
(all misses; the cache is off). Rounds alternate prefetch on / off in the same process; the
ratio of the medians is printed per scenario with the spread of the per-round ratios, how
many items the forward took prefetched, and the engine thread's time outside the forward
per image (the finish in line, or the wait for a prefetch): what the overlap moved off it.

The model is bench_video_serve's Qwen2.5-VL-style checkpoint (bench_tower's 6-layer,
256-wide tower, random weights, fp32), images 112² to 448².
Run: python benchmarks/bench_finish_overlap.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_video_serve import write_model  # noqa: E402

from epd_encoder.api.metrics import Metrics  # noqa: E402
from epd_encoder.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from epd_encoder.engine.build import build_engine  # noqa: E402
from epd_encoder.engine.loop import FutureSink  # noqa: E402
from epd_encoder.engine.worker import EncodeRequest, WorkItem  # noqa: E402
from epd_encoder.models.executor import VisionExecutor  # noqa: E402
from epd_encoder.models.registry import load_vision_model  # noqa: E402
from epd_encoder.preprocess.registry import load_preprocessor  # noqa: E402
from epd_encoder.server.executor import PixelSource, ServingExecutor  # noqa: E402

SIZES = [(112, 112), (448, 448), (224, 336), (336, 224), (168, 448), (448, 280), (392, 392), (280, 168)]
# (name, concurrency, max_batch_cost): the issue's setting, where every batch takes all that is
# pending (so there is no next batch to preview), and a queue a few batches deep.
SCENARIOS = [("c8 budget 16384 (issue setting)", 8, 16384), ("c32 budget 4096 (deep queue)", 32, 4096)]


def staged_images(pre, n: int):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        h, w = SIZES[i % len(SIZES)]
        out.append(pre.stage(Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))))
    return out


def run(tower, pre, staged, *, prefetch: bool, concurrency: int, budget: int, requests: int):
    metrics = Metrics()
    engine_cfg = replace(EngineConfig(), scheduler=replace(SchedulerConfig(), max_batch_cost=budget),
                         cache=CacheConfig(cache_mb=0))
    serving = ServingExecutor(tower, pre, metrics, max_batch_cost=budget, prefetch=prefetch)
    encode, in_encode = serving.encode, [0.0]

    def timed_encode(payloads):  # engine-thread time per batch: finish (or wait) + forward
        t0 = time.perf_counter()
        try:
            return encode(payloads)
        finally:
            in_encode[0] += time.perf_counter() - t0

    serving.encode = timed_encode  # type: ignore[method-assign]
    loop = build_engine(engine_cfg, serving).start()
    counter, lock = itertools.count(), threading.Lock()

    def client() -> None:
        while True:
            with lock:
                n = next(counter)
            if n >= requests:
                return
            s = staged[n % len(staged)]
            cost = s.grid_thw[0] * s.grid_thw[1] * s.grid_thw[2]
            key = n.to_bytes(8, "little") + bytes(24)
            sink = FutureSink()
            loop.submit(EncodeRequest(f"r{n}", (WorkItem(key, cost, PixelSource(s, lambda s=s: s, cost, key=key)),)),
                        sink)
            result = sink.future.result(600)
            assert result.outcome.state == "done", result.outcome
            result.release()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    loop.stop()
    assert not serving.prefetch_thread_alive  # the engine's stop ends the side thread
    forward = sum(s.value for fam in metrics.registry.collect() for s in fam.samples
                  if s.name == "epd_forward_seconds_sum")
    # What the engine thread spent outside the forward, per image: the finish in line, or the wait for it.
    return requests / wall, serving.prefetched / requests, (in_encode[0] - forward) / requests, \
        (in_encode[0] - forward) / in_encode[0]


def finish_seconds(pre, staged) -> float:
    t0 = time.perf_counter()
    for s in staged:
        pre.finish(s, None)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, requests = (2, 48) if args.quick else (4, 128)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp) / "model")
        model = load_vision_model(path, dtype="float32", device="cpu", model_id="bench")
        tower = VisionExecutor(model.tower, device="cpu", dtype=model.dtype)
        pre = load_preprocessor(path)
    staged = staged_images(pre, len(SIZES) * 4)
    per_image_finish = min(finish_seconds(pre, staged) for _ in range(3)) / len(staged)
    print(f"torch threads={torch.get_num_threads()}  rounds={rounds} x {requests} requests of 1 image"
          f"  finish={per_image_finish * 1e3:.2f} ms/image (mean over 112²..448²)")
    print(f"{'scenario':34} {'on img/s':>9} {'off img/s':>9} {'on/off':>7} {'spread':>13} {'prefetched':>10}"
          f" {'engine-thread finish ms/img on/off':>36}")
    for name, concurrency, budget in SCENARIOS:
        got: dict[bool, list[float]] = {True: [], False: []}
        taken, shares, finish_ms = [], [], {True: [], False: []}  # type: ignore[var-annotated]
        for r in range(rounds):
            for prefetch in ((True, False) if r % 2 == 0 else (False, True)):
                ips, frac, outside, share = run(tower, pre, staged, prefetch=prefetch, concurrency=concurrency,
                                                budget=budget, requests=requests)
                got[prefetch].append(ips)
                finish_ms[prefetch].append(outside * 1e3)
                if prefetch:
                    taken.append(frac)
                else:
                    shares.append(share)
        on, off = statistics.median(got[True]), statistics.median(got[False])
        ratios = [a / b for a, b in zip(got[True], got[False])]
        print(f"{name:34} {on:9.1f} {off:9.1f} {on / off:6.3f}x {min(ratios):5.2f}..{max(ratios):5.2f}x"
              f" {statistics.median(taken):9.0%} {statistics.median(finish_ms[True]):17.2f} /"
              f" {statistics.median(finish_ms[False]):.2f}"
              f"  (in line: {statistics.median(shares):.1%} of engine time, the most the overlap can gain)")


if __name__ == "__main__":
    main()
