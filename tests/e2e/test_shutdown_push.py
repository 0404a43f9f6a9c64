# SPDX-License-Identifier: Apache-2.0
"""SIGTERM to a real server process: push rooms accepted before it still reach their receiver."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer.messages import WireItem, layout
from tests.e2e.harness import body, png

FLUSHING = "open push room"  # PushSender.close logs it while it lets open rooms finish


class ServerProcess:
    """``epd-encoder serve`` in a child process; its log lines are collected as they come."""

    def __init__(self, model_dir, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd_encoder.cli", "serve", "--model", str(model_dir), "--port", str(port),
             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become ready:\n" + "".join(self.lines[-30:]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)


def poll_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def serving(tiny_dir):
    s = ServerProcess(tiny_dir, "--drain-timeout", "20")
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


def test_sigterm_right_after_a_202_still_delivers_the_room(serving):
    image = png(1200)
    with httpx.Client(base_url=serving.url, timeout=30) as c:
        info = c.post("/v1/encode", json=body(image, delivery={"mode": "pull"})).json()["items"][0]
        fields = {f: info[f] for f in ("key", "num_tokens", "grid_thw", "hidden_size", "dtype", "num_deepstack")}
        room_bytes = layout([WireItem(**fields)])[1]
        # The pool fits one room: while "hog" is held, the next room's Offer waits for space,
        # so that room is still open when the server is told to stop.
        with EmbeddingReceiver("tcp", pool_bytes=room_bytes * 3 // 2, bootstrap_timeout=30.0) as rx:
            assert c.post("/v1/encode", json=body(image, delivery=rx.delivery("hog"))).status_code == 202
            hog = rx.wait("hog", timeout=20, copy=False)
            r = c.post("/v1/encode", json=body(image, delivery=rx.delivery("drain")))
            assert r.status_code == 202, r.text
            serving.proc.send_signal(signal.SIGTERM)
            assert poll_until(lambda: serving.logged(FLUSHING) or rx.poll("drain") == "failed", timeout=30), \
                "".join(serving.lines[-30:])
            want = hog[0].embedding.clone()
            rx.release("hog")
            got = rx.wait("drain", timeout=20)
    assert torch.equal(got[0].embedding, want) and got[0].key == info["key"]
    # uvicorn re-raises the signal once its graceful shutdown is done.
    assert serving.proc.wait(30) in (0, -signal.SIGTERM)
    assert serving.logged("Application shutdown complete"), "".join(serving.lines[-30:])


def test_a_room_still_queued_for_the_tower_at_shutdown_is_delivered(tiny_dir):
    from tests.e2e.harness import Server, serve_config

    s = Server(serve_config(tiny_dir)).start()
    stopper = threading.Thread(target=s.stop)  # the path SIGTERM takes: uvicorn exits, then Runtime.stop
    try:
        with EmbeddingReceiver("tcp", pool_bytes=8 << 20) as rx:
            with s.paused_engine(), httpx.Client(base_url=s.url, timeout=30) as c:
                r = c.post("/v1/encode", json=body(png(1201), delivery=rx.delivery("queued")))
                assert r.status_code == 202, r.text
                stopper.start()
                assert poll_until(lambda: not s.runtime.ready, timeout=10)  # the stop has begun
            got = rx.wait("queued", timeout=20)
            assert got[0].key == r.json()["items"][0]["key"]
    finally:
        if stopper.ident is None:
            stopper.start()
        stopper.join(30)
    assert not s.runtime.engine.running
