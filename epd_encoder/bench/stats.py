# SPDX-License-Identifier: Apache-2.0
"""One load point's numbers from its outcomes: throughput, latency percentiles, errors."""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

from epd_encoder.bench.load import PointRun

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_ms(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in QUANTILES:
        p = percentile(values, q)
        out[f"p{q}"] = None if p is None else p * 1e3
    out["mean"] = sum(values) / len(values) * 1e3 if values else None
    out["max"] = max(values) * 1e3 if values else None
    return out


def summarize(run: PointRun) -> dict:
    ok = [(req, o) for req, o in run.done if o.ok]
    images = sum(req.images for req, _ in ok)
    videos = sum(req.videos for req, _ in ok)
    wall = run.wall_s if run.wall_s > 0 else float("inf")  # nothing ran: 0/s
    cache = Counter(c for _, o in ok for c in o.cache)
    return {
        "requests": {"sent": len(run.done), "ok": len(ok), "failed": len(run.done) - len(ok), "late": run.late},
        "wall_s": run.wall_s,
        "throughput": {"requests_per_s": len(ok) / wall, "images_per_s": images / wall,
                       "videos_per_s": videos / wall, "items_per_s": (images + videos) / wall},
        "latency_ms": {"metadata": latency_ms([o.metadata_s for _, o in ok if o.metadata_s is not None]),
                       "embeddings": latency_ms([o.embeddings_s for _, o in ok if o.embeddings_s is not None])},
        "errors": dict(sorted(Counter(o.status for _, o in run.done if not o.ok).items())),
        "error_codes": dict(sorted(Counter(f"{o.status} {o.error}" for _, o in run.done
                                           if not o.ok and o.error).most_common(10))),
        "client_cache": dict(sorted(cache.items())),  # per item, as the answers said
    }
