# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder bench`` end to end against real tiny servers, a second or two of load each."""

from __future__ import annotations

import dataclasses
import json

import pytest

from epd_encoder.bench.cli import main
from epd_encoder.bench.report import check
from epd_encoder.bench.workload import WorkloadSpec, parse_sizes, plan
from epd_encoder.config import SchedulerConfig
from tests.e2e.harness import Server, png, serve_config
from tests.models import hub_layouts
from tests.preprocess import tv_reference


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = Server(serve_config(tiny_dir)).start()
    yield s
    s.stop()


def bench(tmp_path, *argv):
    out = tmp_path / "out"
    rc = main(["--output", str(out), "--no-progress", "--warmup", "1", *argv])
    return rc, out


def results(out):
    doc = json.loads((out / "results.json").read_text())
    check(doc)
    return doc


@pytest.mark.parametrize("delivery", ["inline", "pull", "push"])
def test_against_a_running_server(server, tmp_path, capsys, delivery):
    seed = str(["inline", "pull", "push"].index(delivery) + 11)  # the server is shared: new content each
    rc, out = bench(tmp_path, "--url", server.url, "--delivery", delivery, "--concurrency", "1,3",
                    "--num-requests", "12", "--image-sizes", "56x56,84-112", "--duplicate-rate", "0.5",
                    "--pool-size", "4", "--seed", seed)
    assert rc == 0
    doc = results(out)
    (run,) = doc["runs"]
    assert run["delivery"] == delivery and run["info"]["model"] == "tiny-test"
    assert [p["load"]["value"] for p in run["points"]] == [1, 3]
    for p in run["points"]:
        assert p["requests"] == {"sent": 12, "ok": 12, "failed": 0, "late": 0} and p["errors"] == {}
        meta, emb = p["latency_ms"]["metadata"], p["latency_ms"]["embeddings"]
        assert 0 < meta["p50"] <= emb["p50"] and emb["p50"] <= emb["p90"] <= emb["p99"]
        assert p["throughput"]["images_per_s"] > 0
        s = p["server"]
        assert sum(s["items"].values()) == 12  # every item of the point, nothing of the warm-up
        # Duplicates (about half after the first) are hits or coalesced; point 2 repeats nothing of point 1.
        assert 2 <= s["items"]["hit"] + s["items"]["coalesced"] <= 10 and s["items"]["miss"] >= 2
        assert s["batches"] >= 1 and s["batch_items_mean"] >= 1 and 0 < s["batch_fill_mean"] <= 1
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert "meta p50/p90/p99" in capsys.readouterr().out


def test_open_loop_and_a_baseline_url(server, tmp_path):
    rc, out = bench(tmp_path, "--url", server.url, "--baseline-url", server.url, "--rate", "20",
                    "--duration", "0.6", "--image-sizes", "56x56")
    assert rc == 0
    doc = results(out)
    assert [r["name"] for r in doc["runs"]] == ["ours", "url"]
    (ratio,) = doc["ratios"]["url"]
    assert ratio["load"] == {"mode": "rate", "value": 20.0} and ratio["throughput"] > 0
    for run in doc["runs"]:
        assert 3 <= run["points"][0]["requests"]["ok"] <= 30  # about 12 Poisson arrivals in 0.6 s


def test_video_share(server, tmp_path):
    rc, out = bench(tmp_path, "--url", server.url, "--video-share", "0.5", "--num-requests", "6",
                    "--concurrency", "2", "--video-seconds", "1", "--image-sizes", "56x56", "--seed", "21")
    assert rc == 0
    (p,) = results(out)["runs"][0]["points"]
    assert p["requests"]["ok"] == 6 and p["errors"] == {}
    videos = p["throughput"]["videos_per_s"] * p["wall_s"]
    assert 1 <= round(videos) <= 5 and round(videos + p["throughput"]["images_per_s"] * p["wall_s"]) == 6


def test_trace_replay(server, tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(png(500 + i, (56, 56)))
    rows = [{"timestamp": 100.0, "media": ["0.png"]}, {"timestamp": 100.2, "media": ["1.png", "0.png"]},
            {"timestamp": 100.4, "media": ["2.png"]}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    rc, out = bench(tmp_path, "--url", server.url, "--trace", str(tmp_path / "t.jsonl"))
    assert rc == 0
    (p,) = results(out)["runs"][0]["points"]
    assert p["load"]["mode"] == "trace" and p["requests"]["ok"] == 3 and p["wall_s"] >= 0.4
    assert p["throughput"]["images_per_s"] * p["wall_s"] == pytest.approx(4)


@pytest.mark.skipif(tv_reference.missing_reason() is not None, reason=str(tv_reference.missing_reason()))
def test_started_server_beside_the_naive_baseline(tiny_dir, tmp_path, capsys):
    rc, out = bench(tmp_path, "--model", str(tiny_dir), "--baseline", "naive", "--concurrency", "2",
                    "--num-requests", "8", "--image-sizes", "56x56", "--delivery", "pull",
                    "--serve-arg=--max-batch-cost=4096")
    assert rc == 0, capsys.readouterr().err
    doc = results(out)
    ours, naive = doc["runs"]
    assert ours["info"]["limits"]["max_batch_cost"] == 4096  # the pass-through flag reached serve
    assert (ours["delivery"], naive["delivery"]) == ("pull", "inline") and naive["info"] is None
    assert naive["points"][0]["requests"]["ok"] == 8 and naive["points"][0]["server"] is None
    (ratio,) = doc["ratios"]["naive"]
    assert ratio["throughput"] > 0 and ratio["p99_embeddings"] > 0
    assert "ours/naive at concurrency 2" in capsys.readouterr().out
    assert (out / "ours.log").is_file() and (out / "results.png").is_file()


@pytest.mark.skipif(hub_layouts.missing_reason() is not None, reason=str(hub_layouts.missing_reason()))
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_naive_baseline_on_a_hub_layout(family, tmp_path, capsys):
    """The checkpoint as the Hub has it (Qwen2.5-VL: no video_preprocessor_config.json): both
    servers start; the naive one takes its video settings where transformers does."""
    rc, out = bench(tmp_path, "--model", str(hub_layouts.hub_checkpoint(family)), "--baseline", "naive",
                    "--concurrency", "1", "--num-requests", "4", "--image-sizes", "56x56",
                    "--video-share", "0.5", "--video-seconds", "1", "--video-size", "64x48", "--seed", "3")
    assert rc == 0, capsys.readouterr().err
    measured = plan(WorkloadSpec(parse_sizes("56x56"), video_share=0.5), 3, 1, 4)  # point 0: namespace 1
    assert 0 < sum(r.videos for r in measured) < 4  # images and videos both
    ours, naive = results(out)["runs"]
    for run in (ours, naive):
        assert run["points"][0]["requests"]["ok"] == 4, run["points"][0]["requests"]


REFERENCE = "scheduling" in {f.name for f in dataclasses.fields(SchedulerConfig)}


@pytest.mark.skipif(not REFERENCE, reason="serve --scheduling (SchedulerConfig.scheduling) is not there yet")
def test_reference_scheduling_baseline(tiny_dir, tmp_path):
    rc, out = bench(tmp_path, "--model", str(tiny_dir), "--baseline", "reference", "--concurrency", "2",
                    "--num-requests", "6", "--image-sizes", "56x56", "--", "--max-batch-items", "4")
    assert rc == 0
    doc = results(out)
    assert [r["name"] for r in doc["runs"]] == ["ours", "reference"]
    for run in doc["runs"]:
        assert run["info"]["limits"]["max_batch_items"] == 4 and run["points"][0]["requests"]["ok"] == 6


def test_a_server_that_does_not_start_fails_with_its_log(tmp_path, capsys):
    rc, _ = bench(tmp_path, "--model", str(tmp_path / "nowhere"), "--num-requests", "1")
    assert rc == 1
    assert "no such directory" in capsys.readouterr().err


def test_a_failed_baseline_still_writes_ours(server, tmp_path, capsys):
    rc, out = bench(tmp_path, "--url", server.url, "--baseline-url", "http://127.0.0.1:9", "--num-requests", "2",
                    "--image-sizes", "56x56", "--seed", "31")
    assert rc == 1 and "error: url: url: warm-up request failed: transport" in capsys.readouterr().err
    doc = results(out)
    assert [r["name"] for r in doc["runs"]] == ["ours"] and doc["failed"] == ["url"] and doc["ratios"] == {}


@pytest.mark.parametrize("argv,needle", [
    ([], "give --url"),
    (["--url", "http://x", "--baseline", "naive"], "give --model"),
    (["--url", "http://x", "--concurrency", "2", "--rate", "3"], "exclude each other"),
    (["--url", "http://x", "--duration", "2", "--num-requests", "3"], "exclude each other"),
    (["--url", "http://x", "--concurrency", "1.5"], "whole numbers"),
    (["--url", "http://x", "--image-sizes", "big"], "WxH"),
    (["--url", "http://x", "--duplicate-rate", "2"], "fractions"),
])
def test_bad_flags_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err
