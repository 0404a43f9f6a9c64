# SPDX-License-Identifier: Apache-2.0
"""benchmarks/soak.py reads today's /metrics: every gauge its report names is served (issue 11
renamed the metrics and no soak ran to notice), and its check flags what did not come back.
The run itself is minutes long (``soak.py --quick`` is the smoke run, about two minutes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx

from tests.e2e.harness import Server, serve_config

ROOT = Path(__file__).resolve().parents[1]


def _soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("soak", module)
    spec.loader.exec_module(module)
    return module


def test_every_gauge_the_soak_reports_is_served(tmp_path):
    from epd_encoder.models.tiny import write_tiny_model

    soak = _soak()
    server = Server(serve_config(write_tiny_model("qwen2_5_vl", tmp_path / "tiny"))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            served = soak.gauges(c)
    finally:
        server.stop()
    named = [k for k in soak.REPORTED if k.startswith("epd_")] + ["epd_cache_bytes{tier=l1}"]
    assert not [k for k in named if k not in served], sorted(served)


def test_the_check_flags_what_did_not_come_back():
    soak = _soak()
    base = {"rss_mib": 300.0, "fds": 9.0, "threads": 12.0, "epd_cache_pinned_entries": 0.0,
            "epd_cache_bytes{tier=l1}": 0.0}
    assert soak.check(base, dict(base), rss_margin=64) == []
    leaked = {**base, "fds": 20.0, "epd_cache_pinned_entries": 1.0}
    problems = soak.check(base, leaked, rss_margin=64)
    assert any(p.startswith("fds") for p in problems) and any("pinned" in p for p in problems)


def test_every_hostile_case_has_its_expected_outcome():
    soak = _soak()
    assert set(soak.EXPECTED) == set(soak.HOSTILE)
    assert all(callable(getattr(soak.Hostile, kind, None)) for kind in soak.HOSTILE)
