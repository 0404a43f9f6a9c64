# SPDX-License-Identifier: Apache-2.0
"""Host memory under large images: decoding is admitted by predicted bytes, a duplicate
of queued work holds no pixels of its own, and what a burst of large images allocated
goes back to the OS once the server is idle."""

from __future__ import annotations

import base64
import io
import socket
import subprocess
import sys
import threading
from dataclasses import replace

import httpx
import pytest
import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from epd_encoder.config import LimitsConfig
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, body, flat_png, metric, serve_config, wait_for

MiB = 1 << 20


def test_decoding_is_admitted_by_predicted_bytes(tiny_dir):
    # 1000x1000 predicts ~12 MiB with the torchvision backend: over a 1 MiB budget, so
    # each image decodes alone although four preprocessing threads are free. Each decode
    # waits for the test's turn, given only once the other items are seen at the budget's gate.
    limits = replace(LimitsConfig(), max_decoded_mb=1)
    server = Server(serve_config(tiny_dir, limits=limits, preprocess_workers=4)).start()
    try:
        pre, front, lock = server.runtime.preprocessor, server.runtime.front, threading.Lock()
        real, running, seen = pre.stage, [0], [0]
        started, turn = threading.Semaphore(0), threading.Semaphore(0)

        def stage(image, **kw):
            with lock:
                running[0] += 1
                seen[0] = max(seen[0], running[0])
            started.release()
            try:
                assert turn.acquire(timeout=60)
                return real(image, **kw)
            finally:
                with lock:
                    running[0] -= 1

        pre.stage = stage
        with httpx.Client(base_url=server.url, timeout=60) as c:
            out: list = []
            post = threading.Thread(target=lambda: out.append(c.post(
                "/v1/encode", json=body(*(flat_png(i, (1000, 1000)) for i in range(4))))))
            post.start()
            for i in range(4):
                assert started.acquire(timeout=60)
                # The rest reached the gate and were not admitted beside this decode.
                assert wait_for(lambda: front.decoded.waiting == 3 - i), (i, front.decoded.waiting, running[0])
                assert running[0] == 1
                turn.release()
            post.join(60)
            assert out and out[0].status_code == 200, out
            assert seen[0] == 1
            assert wait_for(lambda: metric(c, "epd_decoded_bytes") == 0)
    finally:
        server.stop()


def test_duplicates_of_queued_work_decode_once_and_hold_one_charge(tiny_dir):
    server = Server(serve_config(tiny_dir)).start()
    try:
        pre, rt, decodes = server.runtime.preprocessor, server.runtime, [0]
        real = pre.stage

        def stage(image, **kw):
            decodes[0] += 1
            return real(image, **kw)

        pre.stage = stage
        image, n, out = flat_png(5, (448, 448)), 8, []
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with server.paused_engine():
                posts = []
                for i in range(n):  # one after another: each is queued before the next is sent
                    posts.append(threading.Thread(target=lambda: out.append(
                        httpx.post(f"{server.url}/v1/encode", json=body(image), timeout=60))))
                    posts[-1].start()
                    assert wait_for(lambda: rt.engine.active_requests == i + 1)
                assert decodes[0] == 1
                held = metric(c, "epd_decoded_bytes")  # the one staged copy, while it is queued
                assert held > 0 and held == rt.front.decoded.held and rt.front.decoded.decoding == 0
            for t in posts:
                t.join(60)
            assert len(out) == n and all(r.status_code == 200 for r in out)
            embeddings = [unpack_inline(r.content)[1][0][1].embedding for r in out]
            assert all(torch.equal(e, embeddings[0]) for e in embeddings) and decodes[0] == 1
            assert wait_for(lambda: metric(c, "epd_decoded_bytes") == 0)
    finally:
        server.stop()


# -- RSS of a real server process ---------------------------------------------------

def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def zero_png(i: int, side: int = 7000) -> bytes:
    """A zero-filled side x side PNG (~143 KB at 7000), unique by a text chunk."""
    info = PngInfo()
    info.add_text("n", str(i))
    buf = io.BytesIO()
    Image.new("RGB", (side, side)).save(buf, "PNG", pnginfo=info)
    return buf.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
def test_rss_returns_after_sixteen_7000px_images(tiny_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "epd_encoder.cli", "serve", "--model", str(tiny_dir),
         "--port", str(port), "--request-timeout", "300"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
            def ready() -> bool:
                assert proc.poll() is None, "the server exited"
                try:
                    return c.get("/health").status_code == 200
                except httpx.HTTPError:
                    return False

            assert wait_for(ready, 120)
            before = rss_mib(proc.pid)
            r = c.post("/v1/encode", json={"items": [
                {"type": "image", "image": base64.b64encode(zero_png(i)).decode()} for i in range(16)]})
            assert r.status_code == 200, r.text
            # Unfixed, glibc arenas kept ~900 MiB of freed pixel blocks for good.
            assert wait_for(lambda: rss_mib(proc.pid) < before + 256, 30), (before, rss_mib(proc.pid))
    finally:
        proc.terminate()
        proc.wait(30)
