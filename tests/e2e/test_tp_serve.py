# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder serve --tp 2`` as real processes on loopback (gloo), both modes.

Three servers start together, on the tiny Qwen3-VL (deepstack, video): ``--tp 1
--batch-invariant`` (the reference), ``--tp 2 --tp-mode data --batch-invariant`` and
``--tp 2 --tp-mode weights``. One mixed request (images of three sizes and a video)
goes to each: data mode equals TP1 bitwise (same keys: same checkpoint identity), weights
mode within 1e-5. Then the failure semantics on the real processes: a rank stopped mid
request and then killed fails that request and every new one with 503 ``rank_failed``,
``/health`` answers 503, and the server exits 1 within seconds; SIGTERM with a request held in
flight answers it, takes every rank down with the server, and exits 0.

Bitwise equality holds at the same intra-op thread count: a ``--tp 2`` rank runs
``threads // 2`` threads (the CPU budget split), so the TP1 reference runs with that many
(``--threads``: the server sizes its pool itself, ``OMP_NUM_THREADS`` no longer does).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import torch

from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.tp.group import threads_per_rank
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import b64, png, scrape
from tests.e2e.videos import video

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rank groups need Linux's prctl")

START_S = 150.0  # three servers and two rank processes importing torch at once on 2 busy cores
EXIT_S = 15.0  # detection (heartbeat 1 s) + the 2 s linger + uvicorn's shutdown, with slack


class Serve:
    """``epd-encoder serve`` in a child process; stderr collected line by line."""

    def __init__(self, model_dir, *argv: str, env: dict | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_ENCODER_")}
        full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd_encoder.cli", "serve", "--model", str(model_dir), "--model-id", "tiny",
             "--port", str(port), *argv], env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become ready:\n" + "".join(self.lines[-30:]))

    def ranks(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)


@contextlib.contextmanager
def running(procs: dict[str, Serve], start_s: float):
    """``procs``, all ready within ``start_s`` (they start together); every one closed after."""
    try:
        deadline = time.monotonic() + start_s
        for p in procs.values():
            p.wait_ready(deadline)
        yield procs
    finally:
        for p in procs.values():
            p.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    ckpt = write_tiny_model("qwen3_vl", tmp_path_factory.mktemp("tp-serve") / "qwen3_vl")
    ref_threads = str(threads_per_rank(2))
    with running({
        "tp1": Serve(ckpt, "--batch-invariant", "--threads", ref_threads),
        "data": Serve(ckpt, "--tp", "2", "--tp-mode", "data", "--batch-invariant"),
        "weights": Serve(ckpt, "--tp", "2", "--tp-mode", "weights"),
    }, START_S) as procs:
        yield procs


@pytest.mark.parametrize("argv,rc,cause", [
    (["--tp", "2", "--tower", "reference"], 2, "--tp 2 needs --tower fast"),
    (["--tp", "2", "--tp-heartbeat", "30"], 2, "--tp-heartbeat (30) must be under --tp-timeout (30)"),
    # The tiny tower has 2 heads: found when rank 0 shards its tower, before any rank is spawned.
    (["--tp", "3", "--tp-mode", "weights"], 1, "2 attention heads are not divisible by tensor parallel size 3"),
])
def test_a_tp_setting_that_cannot_work_fails_at_start_up(tmp_path, argv, rc, cause):
    ckpt = write_tiny_model("qwen3_vl", tmp_path / "qwen3_vl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_ENCODER_")}
    r = subprocess.run([sys.executable, "-m", "epd_encoder.cli", "serve", "--model", str(ckpt), "--port", "0", *argv],
                       env=env, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    assert r.returncode == rc and cause in r.stderr and "Traceback" not in r.stderr, r.stderr


def mixed_body(seed: int = 0) -> dict:
    """Images of three sizes and a video; another ``seed`` misses every cache."""
    images = [png(seed + 1, (64, 64)), png(seed + 2, (96, 160)), png(seed + 3, (200, 120))]
    return {"items": [*({"type": "image", "image": b64(i)} for i in images),
                      {"type": "video", "video": b64(video(8, seed=seed + 4))}]}


def encode(server: Serve) -> list:
    r = httpx.post(f"{server.url}/v1/encode", json=mixed_body(), timeout=60)
    assert r.status_code == 200, r.text
    return unpack_inline(r.content)[1]


def tensors(out) -> list[torch.Tensor]:
    return [out.embedding, *(out.deepstack or ())]


def test_info_reflects_tp_and_the_checkpoint_identity_is_tp1s(servers):
    infos = {name: httpx.get(f"{p.url}/info", timeout=10).json() for name, p in servers.items()}
    assert [(i["features"]["tp"], i["features"]["tp_mode"]) for i in infos.values()] == [
        (1, None), (2, "data"), (2, "weights")]
    # One checkpoint digest (TP1's, also for the ranks' shards); data mode computes what TP1
    # does, so its keys are TP1's; the weights server differs only by not being batch-invariant.
    digests = {i["revision"].split(":")[0] for i in infos.values()}
    assert len(digests) == 1, infos
    assert infos["data"]["revision"] == infos["tp1"]["revision"]
    assert infos["weights"]["revision"] == infos["tp1"]["revision"].replace("+batch-invariant", "")
    assert infos["weights"]["num_deepstack"] == infos["tp1"]["num_deepstack"] > 0


def test_both_modes_equal_tp1_on_images_and_a_video(servers):
    want = encode(servers["tp1"])
    assert [m.modality for m, _ in want] == ["image"] * 3 + ["video"] and want[3][0].grid_thw[0] > 1
    data, weights = encode(servers["data"]), encode(servers["weights"])
    for (wm, wo), (dm, do), (gm, go) in zip(want, data, weights):
        assert dm.key == wm.key and dm.grid_thw == gm.grid_thw == wm.grid_thw
        for w, d, g in zip(tensors(wo), tensors(do), tensors(go), strict=True):
            assert torch.equal(d, w), "data mode with --batch-invariant must equal --tp 1 bitwise"
            assert g.shape == w.shape and torch.allclose(g, w, rtol=0, atol=1e-5), (g - w).abs().max()
        assert len(tensors(wo)) == 1 + want[0][0].num_deepstack


def test_a_rank_killed_mid_request_fails_it_and_every_new_one_then_the_server_exits_1(servers):
    server = servers["weights"]
    client = httpx.Client(base_url=server.url, timeout=60)
    [rank] = server.ranks()
    rank.send_signal(signal.SIGSTOP)  # the next batch blocks in its first collective with rank 1
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(client.post("/v1/encode", json=mixed_body(100))))
    sender.start()
    deadline = time.monotonic() + 30
    while scrape(client).get(("epd_pending_cost_patches", frozenset()), 0) == 0:  # accepted: in flight
        assert time.monotonic() < deadline and sender.is_alive(), "the request never reached the engine"
        time.sleep(0.02)
    killed_at = time.monotonic()
    rank.kill()
    sender.join(EXIT_S)
    assert answers and answers[0].status_code == 503, answers and answers[0].text
    err = answers[0].json()["error"]
    assert err["code"] == "rank_failed" and "killed by SIGKILL" in err["message"], err
    # Unhealthy and refusing, with the reason, until the process exits (the 2 s linger).
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "rank_failed", health.text
    refused = client.post("/v1/encode", json={"items": [{"type": "image", "image": b64(png(9))}]})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "rank_failed", refused.text
    assert server.proc.wait(EXIT_S) == 1
    assert time.monotonic() - killed_at < EXIT_S
    assert not rank.is_running()
    client.close()


def refused(url: str) -> bool:
    """A new connection is refused: the server has closed its listener (its shutdown began)."""
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


def test_sigterm_drains_then_takes_every_rank_down(servers):
    server = servers["data"]
    client = httpx.Client(base_url=server.url, timeout=60)
    [rank] = server.ranks()
    assert encode(server)  # the group serves up to the signal
    rank.send_signal(signal.SIGSTOP)  # the next batch waits in its digest exchange with rank 1
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(client.post("/v1/encode", json=mixed_body(200))))
    sender.start()
    deadline = time.monotonic() + 20  # well inside --tp-timeout (30 s): rank 1 is only held
    while scrape(client).get(("epd_pending_cost_patches", frozenset()), 0) == 0:  # accepted: in flight
        assert time.monotonic() < deadline and sender.is_alive(), "the request never reached the engine"
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    while not refused(server.url):  # the drain has begun, the request still held
        assert time.monotonic() < deadline and server.proc.poll() is None, "the server never began its drain"
        time.sleep(0.02)
    assert sender.is_alive() and not answers
    rank.send_signal(signal.SIGCONT)
    sender.join(EXIT_S)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert len(unpack_inline(answers[0].content)[1]) == 4  # the in-flight request, answered in full
    assert server.proc.wait(EXIT_S) == 0  # a drain on SIGTERM is a clean exit
    _, alive = psutil.wait_procs([rank], timeout=5)
    assert not alive, alive
    # Left on a Shutdown message after the drain, not by the parent-death signal.
    server._reader.join(5)
    assert any("rank 1 shuts down" in line for line in server.lines), "".join(server.lines[-20:])
    client.close()
