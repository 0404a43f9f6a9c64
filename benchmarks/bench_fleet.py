# SPDX-License-Identifier: Apache-2.0
"""What affinity routing and the shared tier buy a fleet: three encode servers on loopback,
one Zipf-over-a-pool workload, three set-ups side by side in one run.

- ``rr``: round-robin over the three servers by the load generator itself, no router: what a
  team has with a plain Service in front of N pods. Every server sees the whole pool.
- ``affinity``: the same servers behind ``epd-encoder route`` (Envoy ring-hash on each item's
  routing key): each server sees about a third of the pool.
- ``affinity+shared``: the same, and every server started with ``--shared-cache
  mooncake://...`` on one ``mooncake_master``: an item one server encoded is a hit on another.

Each set-up starts fresh servers (empty caches) and gets the same planned requests in the same
order: request i holds ``--images`` images drawn by Zipf(``--zipf``) over ``--pool`` distinct
PNGs (``--size`` px square, one colour each unless ``--noise``). ``--cache-mb`` bounds each
server's device tier well below the pool (1 MiB holds about 20 of the tiny model's 448² items),
so where an item is cached matters. A warm-up of images outside the pool comes first. Hit rate is
the share of items answered ``cache: hit``, as the servers' per-item metadata says (per tier);
images/s counts answered items over the wall time of the closed loop (``--concurrency``
clients). The rr set-up has no router hop, so the ratios against it are conservative.
Run: python benchmarks/bench_fleet.py [--quick] [--requests 1500] [--concurrency 6]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from epd_encoder.models.tiny import write_tiny_model  # noqa: E402
from tests.router.fleet import Child, Master, Route, Serve, fleet_missing, poll, running  # noqa: E402  (test-only)
from tests.router.loadgen import ZipfPool, closed_loop, encode, png  # noqa: E402  (test-only)
from tests.e2e.harness import flat_png  # noqa: E402  (test-only)

SETUPS = ("rr", "affinity", "affinity+shared")
WARMUP_BASE = 1_000_000  # image ids of the warm-up, outside the pool


def plan(n: int, images: int, pool: int, s: float, seed: int) -> list[list[int]]:
    z = ZipfPool(pool, s, seed)
    return [[z.draw() for _ in range(images)] for _ in range(n)]


def run_setup(name: str, model: Path, work: Path, requests: list[list[int]], args) -> dict:
    side = (args.size, args.size)
    image = (lambda i: png(i, side)) if args.noise else (lambda i: flat_png(i, side))  # noqa: E731
    flags = ["--threads", str(args.threads), "--cache-mb", str(args.cache_mb)]
    master = Master(work / f"{name}-master.log") if name == "affinity+shared" else None
    if master is not None:
        flags += ["--shared-cache", master.url]
    servers = [Serve(f"s{i}", model, work / f"{name}-s{i}.log", *flags) for i in range(3)]
    router = None if name == "rr" else Route("route", [s.url for s in servers], work / f"{name}-route.log")
    stages: list[list[Child]] = [[master]] if master is not None else []
    serving: list[Child] = list(servers)
    stages.append(serving)
    if router is not None:
        stages.append([router])
    with running(*stages):
        if router is not None and not poll(lambda: all(router.healthy(s.url) for s in servers), 30):
            raise RuntimeError(f"envoy did not see every server healthy: {router.hosts()}")
        urls = [router.url] if router is not None else [s.url for s in servers]
        for i, u in enumerate(s.url for s in servers):  # the first forward of each server, unmeasured
            with httpx.Client(base_url=u, timeout=120) as c:
                encode(c, [WARMUP_BASE + i], image=image)
        order, lock = iter(range(len(requests))), threading.Lock()

        def next_ids(_client: int, _n: int) -> list[int]:
            with lock:
                return requests[next(order)]

        pick = itertools.count()
        t0 = time.monotonic()
        load = closed_loop(urls if router is None else urls[0], args.concurrency, next_ids,
                           requests=len(requests) // args.concurrency, timeout=120, image=image,
                           pick=(lambda: next(pick)) if router is None else None)
        wall = time.monotonic() - t0
    items = [it for o in load.outcomes if o.ok for it in o.items]
    tiers = Counter(it.get("tier", "?") for it in items if it["cache"] == "hit")
    lat = np.array([o.end - o.start for o in load.outcomes])
    return {"setup": name, "requests": len(load.outcomes), "failed": sum(not o.ok for o in load.outcomes),
            "items": len(items), "hits": sum(tiers.values()), "tiers": dict(tiers),
            "coalesced": sum(it["cache"] == "coalesced" for it in items), "wall": wall,
            "images_s": len(items) / wall, "p50_ms": 1e3 * float(np.percentile(lat, 50)),
            "p99_ms": 1e3 * float(np.percentile(lat, 99))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="300 requests per set-up over a pool of 120")
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--images", type=int, default=1, help="images per request")
    ap.add_argument("--pool", type=int, default=300)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--size", type=int, default=448, help="side of the square PNGs")
    ap.add_argument("--noise", action="store_true", help="seeded noise PNGs (costly to decode and "
                    "send) instead of one-colour ones (a few KiB; the tower's work is the same)")
    ap.add_argument("--cache-mb", type=int, default=1, help="each server's device tier")
    ap.add_argument("--threads", type=int, default=1, help="each server's --threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--setups", default=",".join(SETUPS))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.pool = 300, 120
    reason = fleet_missing("affinity+shared" in args.setups)
    if reason:
        print(f"bench_fleet skipped: {reason}")
        return 0
    requests = plan(args.requests, args.images, args.pool, args.zipf, args.seed)
    distinct = len({i for r in requests for i in r})
    print(f"{args.requests} requests x {args.images} image(s), Zipf s={args.zipf} over {args.pool} "
          f"({distinct} distinct drawn), {args.size}px {'noise' if args.noise else 'one-colour'}, "
          f"--cache-mb {args.cache_mb} per server, "
          f"{args.concurrency} clients")
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        work = Path(tmp)
        model = write_tiny_model("qwen2_5_vl", work / "tiny")
        rows = []
        for name in args.setups.split(","):
            rows.append(run_setup(name, model, work, requests, args))
            print(f"{name}: {rows[-1]}", flush=True)
    base = rows[0]
    print(f"\n| set-up | hit rate | hits by tier | images/s | p50 ms | p99 ms | failed | "
          f"hit rate vs {base['setup']} | images/s vs {base['setup']} |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        rate = r["hits"] / max(1, r["items"])
        base_rate = base["hits"] / max(1, base["items"])
        tiers = ", ".join(f"{k} {v}" for k, v in sorted(r["tiers"].items())) or "-"
        print(f"| {r['setup']} | {rate:.3f} | {tiers} | {r['images_s']:.1f} | {r['p50_ms']:.0f} | "
              f"{r['p99_ms']:.0f} | {r['failed']} | {rate / max(base_rate, 1e-9):.2f}x | "
              f"{r['images_s'] / base['images_s']:.2f}x |")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
