# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import json

import pytest

from epd_encoder.bench.deliver import Outcome
from epd_encoder.bench.load import PointRun
from epd_encoder.bench.report import SCHEMA, check, document, table, write_json, write_png
from epd_encoder.bench.runner import ratios
from epd_encoder.bench.stats import summarize
from epd_encoder.bench.workload import Media, PlannedRequest


def _run(name, service_s, value):
    req = PlannedRequest((Media("image", 1, 0),))
    done = [(req, Outcome(0, "200", service_s / 2, service_s * (1 + i / 10))) for i in range(10)]
    point = {"load": {"mode": "concurrency", "value": value}, **summarize(PointRun(done, wall_s=service_s * 5)),
             "server": None}
    return point


def _doc():
    ours = {"name": "ours", "url": "http://a", "delivery": "inline",
            "points": [_run("ours", 0.1, 1), _run("ours", 0.2, 4)]}
    naive = {"name": "naive", "url": "http://b", "delivery": "inline",
             "points": [_run("naive", 0.2, 1), _run("naive", 0.8, 4)]}
    return document([ours, naive], {"naive": ratios(ours, naive)}, machine={"cpus": 2})


def test_document_passes_its_schema_and_survives_json(tmp_path):
    doc = _doc()
    check(doc)
    path = write_json(doc, tmp_path / "out")
    back = json.loads(path.read_text())
    check(back)
    assert back["schema"] == SCHEMA and [r["name"] for r in back["runs"]] == ["ours", "naive"]


def test_ratios_are_ours_over_the_baseline_per_point():
    r = _doc()["ratios"]["naive"]
    assert [x["throughput"] for x in r] == pytest.approx([2.0, 4.0])
    assert [x["p99_embeddings"] for x in r] == pytest.approx([0.5, 0.25])


@pytest.mark.parametrize("breaks", ["schema", "point", "latency", "ratio"])
def test_check_refuses_a_document_missing_a_promised_field(breaks):
    doc = _doc()
    if breaks == "schema":
        doc["schema"] = "other"
    elif breaks == "point":
        del doc["runs"][1]["points"][0]["errors"]
    elif breaks == "latency":
        del doc["runs"][0]["points"][1]["latency_ms"]["metadata"]["p90"]
    else:
        del doc["ratios"]["naive"][0]["p99_embeddings"]
    with pytest.raises(ValueError):
        check(doc)


def test_table_has_a_line_per_point_and_the_ratios():
    text = table(_doc())
    assert text.count("\nours ") == 2 and text.count("\nnaive ") == 2
    assert "ours/naive at concurrency 4: throughput 4.00x" in text and "p99 0.25x" in text


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    path = write_png(_doc(), tmp_path)
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_is_said_not_raised(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    said = []
    assert write_png(_doc(), tmp_path, warn=said.append) is None
    assert "matplotlib is not installed" in said[0] and not (tmp_path / "results.png").exists()
