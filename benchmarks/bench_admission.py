# SPDX-License-Identifier: Apache-2.0
"""Hit rate of plain LRU vs TinyLFU admission on Zipf and Zipf-plus-scan traces.

Each trace is replayed against both caches in the same process: a lookup
that misses is followed by a put, as the engine does after an encode.
Run: python benchmarks/bench_admission.py [--quick] [--seed N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from epd_encoder.cache.lru import EmbeddingCache

HIDDEN_BYTES = 2048 * 2  # one bf16 row of a 2048-wide embedding


def zipf_trace(rng, n_keys: int, n_requests: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n_keys + 1) ** s
    return rng.choice(n_keys, size=n_requests, p=p / p.sum())


def with_scans(trace: np.ndarray, n_keys: int, every: int, scan_len: int) -> np.ndarray:
    """Insert a run of ``scan_len`` never-repeated keys after every ``every`` requests."""
    parts, next_id = [], n_keys
    for start in range(0, len(trace), every):
        parts.append(trace[start : start + every])
        parts.append(np.arange(next_id, next_id + scan_len))
        next_id += scan_len
    return np.concatenate(parts)


def sizes_for(rng, n: int, variable: bool) -> np.ndarray:
    if not variable:
        return np.full(n, 1024 * HIDDEN_BYTES, dtype=np.int64)
    tokens = np.exp(rng.uniform(np.log(64), np.log(4096), size=n)).astype(np.int64)
    return tokens * HIDDEN_BYTES


def replay(cache: EmbeddingCache, trace: np.ndarray, sizes: np.ndarray) -> tuple[float, float]:
    keys = [int(k).to_bytes(32, "little") for k in trace]
    nbytes = sizes[trace].tolist()
    t0 = time.perf_counter()
    for key, n in zip(keys, nbytes):
        if cache.get(key) is None:
            cache.put(key, key, n)
    elapsed = time.perf_counter() - t0
    return cache.stats.hit_rate, elapsed / len(keys) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short traces (about 5x fewer requests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--capacity-frac", type=float, default=0.08, help="cache size / key space (by mean bytes)")
    args = ap.parse_args()

    n_requests = 40_000 if args.quick else 200_000
    rng = np.random.default_rng(args.seed)
    base = zipf_trace(rng, args.keys, n_requests, args.zipf_s)
    # (name, trace): scans of 2000 / 1000 never-repeated keys every 4000 / 1000 Zipf requests.
    traces = [
        ("zipf", base),
        ("zipf+scan", with_scans(base, args.keys, 4_000, 2_000)),
        ("zipf+heavy-scan", with_scans(base, args.keys, 1_000, 1_000)),
    ]
    n_ids = max(int(t.max()) for _, t in traces) + 1
    entries = int(args.keys * args.capacity_frac)

    print(
        f"keys={args.keys} zipf_s={args.zipf_s} capacity={args.capacity_frac:.0%} of key space "
        f"(~{entries} entries) zipf requests={n_requests} seed={args.seed}; "
        "zipf+scan: 2000 unique keys every 4000 requests; zipf+heavy-scan: 1000 every 1000"
    )
    print(f"{'workload':<32}{'LRU hit':>9}{'TinyLFU hit':>13}{'ratio':>8}{'LRU us/op':>11}{'TLFU us/op':>12}")
    for variable in (False, True):
        sizes = sizes_for(np.random.default_rng(args.seed + 1), n_ids, variable)
        capacity = int(entries * sizes[: args.keys].mean())
        for name, trace in traces:
            lru = EmbeddingCache(capacity, admission="lru")
            tlfu = EmbeddingCache(capacity, admission="tinylfu", expected_entries=entries)
            h_lru, us_lru = replay(lru, trace, sizes)
            h_tlfu, us_tlfu = replay(tlfu, trace, sizes)
            label = f"{name} ({'variable' if variable else 'equal'} size)"
            ratio = h_tlfu / h_lru if h_lru else float("inf")
            print(f"{label:<32}{h_lru:>9.4f}{h_tlfu:>13.4f}{ratio:>7.2f}x{us_lru:>11.2f}{us_tlfu:>12.2f}")


if __name__ == "__main__":
    main()
