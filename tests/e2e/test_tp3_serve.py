# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder serve --tp 3`` as real processes, both modes, and a rank that hangs.

The tiny towers have 2 heads, so this runs a widened Qwen3-VL checkpoint (6 heads,
deepstack, video; ``tests/tp/test_shard.py``'s ``write_wide_model``) with the tiny
model's processor files. Three servers start together: ``--tp 1 --batch-invariant`` at one
intra-op thread (the reference, by ``--threads``: a ``--tp 3`` rank gets ``threads // 3`` threads, at least
one), ``--tp 3 --tp-mode data --batch-invariant`` (bitwise the reference) and
``--tp 3 --tp-mode weights`` (within 1e-5). Then a rank of the data server is stopped
(SIGSTOP: alive, never answering): the request that needs it fails with 503
``rank_failed`` at ``--tp-timeout``, not at the request timeout, and the server exits 1.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import time

import httpx
import pytest
import torch

from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.tp.group import threads_per_rank
from tests.e2e.harness import b64, png
from tests.e2e.test_tp_serve import EXIT_S, Serve, encode, mixed_body, running, tensors
from tests.tp.test_shard import write_wide_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rank groups need Linux's prctl")

START_S = 180.0  # three servers and four rank processes importing torch at once on 2 cores
TP_TIMEOUT_S = 6.0


def wide_checkpoint(root) -> str:
    """The widened tower's config and weights, beside the tiny model's processor files."""
    tiny = write_tiny_model("qwen3_vl", root / "tiny")
    wide = write_wide_model("qwen3_vl", root / "wide")
    for f in tiny.iterdir():
        if f.is_file() and not (wide / f.name).exists():
            shutil.copyfile(f, wide / f.name)
    return str(wide)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    ckpt = wide_checkpoint(tmp_path_factory.mktemp("tp3-serve"))
    with running({
        "tp1": Serve(ckpt, "--batch-invariant", "--threads", str(threads_per_rank(3))),
        "data": Serve(ckpt, "--tp", "3", "--tp-mode", "data", "--batch-invariant",
                      "--tp-timeout", str(TP_TIMEOUT_S)),
        "weights": Serve(ckpt, "--tp", "3", "--tp-mode", "weights"),
    }, START_S) as procs:
        yield procs


def test_tp3_in_both_modes_equals_tp1_on_images_and_a_video(servers):
    ref = encode(servers["tp1"])
    for mode in ("data", "weights"):
        got = encode(servers[mode])
        if mode == "data":  # one checkpoint identity and tower mode: the same keys
            assert [m.key for m, _ in got] == [m.key for m, _ in ref]
        for (_, a), (_, b) in zip(got, ref):
            assert len(tensors(a)) == len(tensors(b)) > 1  # the embedding and the deepstack levels
            for x, y in zip(tensors(a), tensors(b)):
                if mode == "data":
                    assert torch.equal(x, y)
                else:
                    torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert len(servers["data"].ranks()) == 2 and len(servers["weights"].ranks()) == 2


def test_a_hung_rank_fails_the_request_at_the_tp_timeout_and_the_server_exits_1(servers):
    server = servers["data"]
    client = httpx.Client(base_url=server.url, timeout=120)
    assert client.get("/health").status_code == 200
    ranks = server.ranks()
    for rank in ranks:
        rank.send_signal(signal.SIGSTOP)  # alive (the watchdog sees no exit), never answering
    answers: list[httpx.Response] = []
    sent = time.monotonic()
    # Four fresh items: the largest-first split hands every rank a share.
    sender = threading.Thread(target=lambda: answers.append(client.post("/v1/encode", json=mixed_body(300))))
    sender.start()
    sender.join(TP_TIMEOUT_S + EXIT_S)
    took = time.monotonic() - sent
    assert answers, "no answer after the collective timeout"
    assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "rank_failed", answers[0].text
    assert TP_TIMEOUT_S * 0.8 <= took < TP_TIMEOUT_S + EXIT_S, took  # the collective's timeout, not a hang
    refused = client.post("/v1/encode", json={"items": [{"type": "image", "image": b64(png(11))}]})
    assert refused.status_code == 503, refused.text
    assert server.proc.wait(EXIT_S) == 1
    deadline = time.monotonic() + 5
    while any(r.is_running() and r.status() != "zombie" for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(r.is_running() and r.status() != "zombie" for r in ranks), "a stopped rank outlived the server"
    client.close()
