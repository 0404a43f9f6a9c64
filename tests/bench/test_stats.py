# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import numpy as np
import pytest

from epd_encoder.bench.deliver import Outcome
from epd_encoder.bench.load import PointRun
from epd_encoder.bench.stats import latency_ms, percentile, summarize
from epd_encoder.bench.workload import Media, PlannedRequest


def test_percentile_by_hand():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    assert percentile([5, 1, 4, 2, 3], 0) == 1 and percentile([5, 1, 4, 2, 3], 100) == 5


@pytest.mark.parametrize("n", [2, 7, 100, 1001])
def test_percentile_agrees_with_numpy_linear(n):
    xs = np.random.default_rng(n).exponential(1.0, n).tolist()
    for q in (50, 90, 99, 99.9):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_latency_in_ms():
    out = latency_ms([0.010, 0.020, 0.030])
    assert out["p50"] == pytest.approx(20.0) and out["mean"] == pytest.approx(20.0) and out["max"] == 30.0


def _req(images=1, videos=0):
    return PlannedRequest(tuple([Media("image", 1, i) for i in range(images)] +
                                [Media("video", 1, 100 + i) for i in range(videos)]))


def test_summary_counts_only_answered_requests():
    done = [(_req(2), Outcome(0, "200", 0.01, 0.02, ("miss", "hit"))),
            (_req(0, 1), Outcome(0, "200", 0.03, 0.04, ("coalesced",))),
            (_req(1), Outcome(0, "429", error="overloaded")),
            (_req(1), Outcome(0, "timeout", error="ReadTimeout")),
            (_req(1), Outcome(0, "encode_failed", 0.01, None, ("pending",), error="encode_failed"))]  # a push room
    s = summarize(PointRun(done, wall_s=2.0, late=1))
    assert s["requests"] == {"sent": 5, "ok": 2, "failed": 3, "late": 1}
    assert s["throughput"] == {"requests_per_s": 1.0, "images_per_s": 1.0, "videos_per_s": 0.5,
                               "items_per_s": 1.5}
    assert s["latency_ms"]["embeddings"]["p50"] == pytest.approx(30.0)
    assert s["latency_ms"]["metadata"]["max"] == pytest.approx(30.0)
    assert s["errors"] == {"429": 1, "encode_failed": 1, "timeout": 1}
    assert s["client_cache"] == {"coalesced": 1, "hit": 1, "miss": 1}


def test_summary_of_nothing_is_zero_not_nan():
    s = summarize(PointRun([], wall_s=0.0))
    assert s["throughput"]["images_per_s"] == 0.0 and s["latency_ms"]["embeddings"]["p99"] is None
