# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from epd_encoder.bench.workload import (
    WorkloadSpec,
    Zipf,
    duplicate_fraction,
    load_trace,
    parse_sizes,
    plan,
    poisson_arrivals,
)


@pytest.mark.parametrize("rate,pool", [(0.0, 1000), (0.3, 1000), (0.5, 50), (0.9, 5)])
def test_duplicate_fraction_matches_the_requested_rate(rate, pool):
    reqs = plan(WorkloadSpec(duplicate_rate=rate, pool_size=pool), seed=1, namespace=1, n=4000)
    # Binomial(4000, rate): 4 standard deviations is under 0.032.
    assert duplicate_fraction(reqs) == pytest.approx(rate, abs=0.032)


def test_duplicates_follow_zipf_over_the_pool():
    reqs = plan(WorkloadSpec(duplicate_rate=1.0, pool_size=20, zipf_s=1.2), seed=0, namespace=1, n=20001)
    counts = Counter(r.items[0].index for r in reqs[1:])
    assert set(counts) == {0}  # the pool is one medium until a fresh one joins: rate 1.0 never adds one
    spec = WorkloadSpec(duplicate_rate=0.8, pool_size=20, zipf_s=1.2)
    counts = Counter(m.index for r in plan(spec, seed=0, namespace=1, n=30000) for m in r.items)
    ranks = [counts[i] for i in range(20)]
    assert ranks[0] > ranks[1] > ranks[4] > ranks[19]  # hottest first
    ratio = ranks[0] / ranks[9]  # Zipf: P(1)/P(10) = 10^1.2 ~ 15.8; fresh items add 1 to each
    assert 8 < ratio < 25


def test_bounded_zipf_probabilities():
    z, rng = Zipf(1.0, 4), np.random.default_rng(0)
    draws = Counter(z.draw(rng, 4) for _ in range(40000))
    p = np.array([1, 1 / 2, 1 / 3, 1 / 4]) / sum([1, 1 / 2, 1 / 3, 1 / 4])
    for k in range(4):
        assert draws[k] / 40000 == pytest.approx(p[k], abs=0.01)
    assert {z.draw(rng, 2) for _ in range(200)} == {0, 1}  # n bounds the ranks drawn


def test_plan_is_deterministic_prefix_stable_and_namespaced():
    spec = WorkloadSpec(sizes=parse_sizes("112-448,1024x1024:2"), images_per_request=2, duplicate_rate=0.4,
                        video_share=0.2)
    a = plan(spec, seed=3, namespace=1, n=200)
    assert a == plan(spec, seed=3, namespace=1, n=200)
    assert a[:50] == plan(spec, seed=3, namespace=1, n=50)
    assert a != plan(spec, seed=4, namespace=1, n=200)
    other = plan(spec, seed=3, namespace=2, n=200)
    assert {m.namespace for r in other for m in r.items} == {2}
    sizes = [(m.width, m.height) for r in a for m in r.items if m.kind == "image"]
    assert all(112 <= w <= 448 and 112 <= h <= 448 or (w, h) == (1024, 1024) for w, h in sizes)
    videos = sum(m.kind == "video" for r in a for m in r.items)
    assert 0.1 < videos / (2 * len(a)) < 0.3


def test_size_weights_are_respected():
    spec = WorkloadSpec(sizes=parse_sizes("448x448:3,1920x1080:1"))
    sizes = Counter((r.items[0].width, r.items[0].height) for r in plan(spec, 0, 1, 4000))
    assert sizes[(448, 448)] / 4000 == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize("bad", ["", "448", "448x", "10-", "448x448:0", "a-b"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        parse_sizes(bad)


def test_poisson_inter_arrival_mean_and_duration_bound():
    rng = np.random.default_rng(0)
    times = poisson_arrivals(5.0, rng, n=20000)
    gaps = np.diff([0.0, *times])
    assert gaps.mean() == pytest.approx(0.2, rel=0.03) and (gaps > 0).all()
    assert gaps.std() == pytest.approx(0.2, rel=0.05)  # exponential: std equals mean
    within = poisson_arrivals(10.0, np.random.default_rng(1), duration=50.0)
    assert max(within) < 50.0 and len(within) == pytest.approx(500, abs=4 * 500 ** 0.5)


def test_trace_parsing(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x")
    lines = [{"timestamp": 12.5, "media": ["a.png", "https://example.com/v.mp4?x=1"]},
             {"timestamp": 10.0, "media": [{"type": "video", "ref": "/abs/clip.bin"}]}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    first, second = load_trace(path)
    assert first.at == 0.0 and second.at == 2.5  # sorted, shifted to 0
    assert first.items[0].kind == "video" and first.items[0].ref == "/abs/clip.bin"
    img, vid = second.items
    assert (img.kind, img.ref) == ("image", str(tmp_path / "a.png"))
    assert (vid.kind, vid.ref) == ("video", "https://example.com/v.mp4?x=1")


@pytest.mark.parametrize("line", ['{"media": ["a.png"]}', '{"timestamp": 1, "media": []}',
                                  '{"timestamp": 1, "media": [{"type": "audio", "ref": "a"}]}', "not json"])
def test_bad_trace_lines_name_the_line(tmp_path, line):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "media": ["a.png"]}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2"):
        load_trace(path)
