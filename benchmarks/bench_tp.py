# SPDX-License-Identifier: Apache-2.0
"""``serve --tp 1`` against ``--tp 2 --tp-mode weights`` and ``--tp 2 --tp-mode data``.

The model is bench_video_serve's Qwen2.5-VL-style checkpoint (bench_tower's 6-layer,
256-wide tower, 4 heads, random weights, fp32, tiny LM). Each server is a real
``epd-encoder serve`` subprocess on loopback, one after the other; each gets the same
requests (one unique PNG each, 112² to 448², so no cache hits) from ``--concurrency``
closed-loop HTTP clients in this process for ``--seconds``.

Per server it measures:
- images/s and p50/p99 latency under the closed loop;
- idle CPU: after one warm-up request, the CPU time (user + system) of the server and
  every process under it (the rank processes) over an idle window, as % of one core
  (issue 12: an idle ``--tp 2`` server must stay under 10%);
- the weight bytes each rank holds: not on ``/info``, so computed on the same checkpoint
  with ``tp.shard.shard_stats`` (planned parameter counts) and ``load_vision_shard``
  (the bytes each rank actually reads from the safetensors files).

Prints ratios against ``--tp 1``. On a 2-core host TP2 splits the 2 cores between 2
ranks (1 intra-op thread each), so no speedup is expected there.
Run: python benchmarks/bench_tp.py [--quick] [--seconds 20] [--concurrency 4] [--idle 5]
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_video_serve import TOWER, free_port, make_image, pct, start, write_model  # noqa: E402

CONFIGS = [("tp1", []), ("tp2-weights", ["--tp", "2", "--tp-mode", "weights"]),
           ("tp2-data", ["--tp", "2", "--tp-mode", "data"])]


def tree(pid: int) -> list:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(procs: list) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:  # a process of the tree that ended: counts as no more CPU
            pass
    return total


def rss_mib(procs: list) -> float:
    import psutil

    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def encode(c: httpx.Client, data: bytes) -> None:
    r = c.post("/v1/encode", json={"items": [{"type": "image", "image": base64.b64encode(data).decode()}]})
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:200]}")


def run_one(name: str, cmd: list[str], url: str, images: list[bytes], seconds: float, idle_s: float,
            concurrency: int, log: Path) -> dict:
    """Start, warm up, measure the idle window, run the closed loop, stop."""
    proc = start(cmd, url, log)
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            for seed in (10**6, 10**6 + 1):  # the first forward pays one-off costs (allocations, thread pools)
                encode(c, make_image(seed))
        procs = tree(proc.pid)
        ranks = len(procs) - 1
        before, t0 = cpu_seconds(procs), time.perf_counter()
        time.sleep(idle_s)  # the measurement itself: a window with no request in it
        idle_pct = 100 * (cpu_seconds(procs) - before) / (time.perf_counter() - t0)
        rss = rss_mib(procs)

        done: list[float] = []
        lock, it = threading.Lock(), iter(images)
        stop_at = time.monotonic() + seconds
        errors: list[BaseException] = []

        def client() -> None:
            try:
                with httpx.Client(base_url=url, timeout=120) as c:
                    while time.monotonic() < stop_at:
                        with lock:
                            data = next(it, None)
                        if data is None:
                            return
                        t = time.perf_counter()
                        encode(c, data)
                        with lock:
                            done.append(time.perf_counter() - t)
            except BaseException as e:  # surfaced after the join, with the config's name
                errors.append(e)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"{name}: {errors[0]}")
        if next(it, None) is None:
            print(f"warning: {name} ran out of requests before --seconds")
    finally:
        proc.terminate()
        proc.wait(60)
    out = {"images_per_s": len(done) / wall, "p50_ms": pct(done, 50) * 1e3, "p99_ms": pct(done, 99) * 1e3,
           "idle_cpu_pct": idle_pct, "processes": ranks + 1, "rss_mib": rss, "requests": len(done)}
    print(f"{name:>12}: {out['images_per_s']:6.2f} images/s  p50 {out['p50_ms']:7.1f} ms  "
          f"p99 {out['p99_ms']:7.1f} ms  ({len(done)} requests, {wall:.1f} s); idle CPU "
          f"{idle_pct:5.2f}% of a core over {idle_s:g} s ({ranks + 1} processes, RSS {rss:.0f} MiB)")
    return out


def weight_bytes(model_dir: Path, world: int) -> dict:
    """Per-rank planned parameters (shard_stats) and bytes read from the checkpoint (load_vision_shard)."""
    import torch
    from transformers import AutoConfig

    from epd_encoder.models.registry import get_family
    from epd_encoder.tp.shard import load_vision_shard, shard_stats

    cfg = AutoConfig.from_pretrained(model_dir)
    family = get_family(cfg.model_type)
    with torch.device("meta"):
        tower = family.build_tower(cfg)
    stats = shard_stats(family.name, tower, world)
    read = []
    for r in range(world):  # no process group: each rank's slices are read alone, as a rank reads them
        _, report = load_vision_shard(model_dir, r, world, dtype="float32", progress=False)
        read.append(report.bytes)
    _, whole = load_vision_shard(model_dir, 0, 1, dtype="float32", progress=False)
    return {"stats": stats, "read": read, "whole": whole.bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few seconds per server")
    ap.add_argument("--seconds", type=float, default=20.0, help="closed-loop seconds per server")
    ap.add_argument("--idle", type=float, default=5.0, help="idle window in seconds")
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    try:
        import psutil  # noqa: F401  (the idle CPU reads the process tree)
    except ImportError:
        print("skipped: psutil is not installed (pip install -e '.[test]')")
        return
    seconds, idle_s = (3.0, 2.0) if args.quick else (args.seconds, args.idle)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model")
        # More requests than any server finishes: the run is bounded by time, not by the list.
        images = [make_image(i) for i in range(120 if args.quick else int(seconds * 60))]
        print(f"model: Qwen2.5-VL-style, tower {TOWER['depth']}x{TOWER['hidden_size']}, {TOWER['num_heads']} "
              f"heads, fp32, {os.cpu_count()} CPUs; {args.concurrency} clients; {seconds:g} s per server; "
              f"idle window {idle_s:g} s")
        results = {}
        for name, extra in CONFIGS:
            port = free_port()
            cmd = [sys.executable, "-m", "epd_encoder.cli", "serve", "--model", str(model_dir),
                   "--port", str(port), *extra]
            results[name] = run_one(name, cmd, f"http://127.0.0.1:{port}", images, seconds, idle_s,
                                    args.concurrency, Path(tmp) / f"{name}.log")
        w = weight_bytes(model_dir, 2)
    base = results["tp1"]
    for name in ("tp2-weights", "tp2-data"):
        r = results[name]
        print(f"ratio {name}/tp1: images/s {r['images_per_s'] / base['images_per_s']:.2f}x  "
              f"p50 {r['p50_ms'] / base['p50_ms']:.2f}x  p99 {r['p99_ms'] / base['p99_ms']:.2f}x  "
              f"idle CPU {r['idle_cpu_pct']:.2f}% vs {base['idle_cpu_pct']:.2f}%")
    s = w["stats"]
    mib = 4 / 2**20  # fp32 parameters
    print(f"weights per rank (fp32): tp1 {s.total * mib:.2f} MiB (blocks {s.block_total * mib:.2f}); "
          f"tp2-data {s.total * mib:.2f} MiB on each rank (a replica)")
    for rank in range(s.world):
        held = s.per_rank[rank]
        print(f"  tp2-weights rank {rank}: {held * mib:.2f} MiB = {held / s.total:.3f} of the tower "
              f"(blocks {s.block_per_rank[rank] / s.block_total:.3f}; replicated {s.replicated * mib:.2f} MiB); "
              f"read from the checkpoint {w['read'][rank] / 2**20:.2f} MiB of {w['whole'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
