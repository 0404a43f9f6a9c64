# SPDX-License-Identifier: Apache-2.0
"""Per-batch cost of EncodeScheduler against a sort-every-batch greedy baseline.

Both run side by side in one process at a steady pending count P: after each
batch the same number of fresh items is added, so P stays constant. Only batch
formation is timed. Costs are pre-merge patch counts of images whose grids are
8..64 patches per side (64..4096 patches); budget 16384, cap 64.

    python benchmarks/bench_scheduler.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import time

from epd_encoder.engine.scheduler import EncodeScheduler, PendingEncodeItem

BUDGET, CAP = 16384, 64


class SortEveryBatch:
    """Baseline: sort all pending keys by (request_id, item_index), then greedy-pack."""

    def __init__(self, max_batch_cost: int, max_batch_items: int) -> None:
        self._max_cost, self._max_items = max_batch_cost, max_batch_items
        self._pending: dict[tuple[str, int], PendingEncodeItem] = {}

    def add(self, item: PendingEncodeItem) -> None:
        self._pending[(item.request_id, item.item_index)] = item

    def pending_size(self) -> int:
        return len(self._pending)

    def next_batch(self) -> list[PendingEncodeItem]:
        batch: list[PendingEncodeItem] = []
        remaining = self._max_cost
        for key in sorted(self._pending):
            it = self._pending[key]
            if it.cost <= remaining or not batch:
                batch.append(it)
                remaining -= it.cost
                if len(batch) == self._max_items or remaining <= 0:
                    break
        for it in batch:
            del self._pending[(it.request_id, it.item_index)]
        return batch


class Workload:
    """A deterministic stream of requests of 1..3 images each."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._buffer: list[PendingEncodeItem] = []

    def take(self, n: int) -> list[PendingEncodeItem]:
        while len(self._buffer) < n:
            rid = f"{self._rng.getrandbits(64):016x}"
            for idx in range(self._rng.randint(1, 3)):
                h, w = self._rng.randrange(8, 65, 2), self._rng.randrange(8, 65, 2)
                self._buffer.append(PendingEncodeItem(rid, idx, h * w))
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out


def measure(sched, pending: int, batches: int, seed: int) -> tuple[float, float, float]:
    """Return (µs per batch, µs per item, mean fill of the budget) at ``pending``."""
    work = Workload(seed)
    for it in work.take(pending):
        sched.add(it)
    sched.next_batch()  # warm-up
    elapsed, items, cost = 0.0, 0, 0
    for _ in range(batches):
        for it in work.take(pending - sched.pending_size()):
            sched.add(it)
        t0 = time.perf_counter()
        batch = sched.next_batch()
        elapsed += time.perf_counter() - t0
        items += len(batch)
        cost += sum(it.cost for it in batch)
    return elapsed / batches * 1e6, elapsed / items * 1e6, cost / batches / BUDGET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run")
    args = ap.parse_args()
    sizes = (1_000, 10_000, 100_000)
    ours_batches = 300 if args.quick else 3000
    base_batches = {1_000: 200, 10_000: 40, 100_000: 8} if args.quick else {
        1_000: 2000, 10_000: 300, 100_000: 40}
    print(f"budget={BUDGET} cap={CAP} lookahead=64 max_skips=8")
    print(f"{'pending':>8} {'ours µs/batch':>14} {'ours µs/item':>13} "
          f"{'sort µs/batch':>14} {'sort µs/item':>13} {'ratio':>8} {'fill ours/sort':>15}")
    for p in sizes:
        ours = measure(EncodeScheduler(BUDGET, CAP), p, ours_batches, seed=p)
        base = measure(SortEveryBatch(BUDGET, CAP), p, base_batches[p], seed=p)
        print(f"{p:>8} {ours[0]:>14.2f} {ours[1]:>13.3f} "
              f"{base[0]:>14.1f} {base[1]:>13.2f} {base[0] / ours[0]:>7.0f}x "
              f"{ours[2]:>8.1%}/{base[2]:.1%}")


if __name__ == "__main__":
    main()
