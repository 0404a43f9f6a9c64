# SPDX-License-Identifier: Apache-2.0
"""Host memory under large images: decoding is admitted by predicted bytes, and
what a burst of them allocated goes back to the OS once the server is idle."""

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
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from epd_encoder.config import LimitsConfig
from tests.e2e.harness import Server, body, flat_png, metric, serve_config, wait_for

MiB = 1 << 20


def test_decoding_is_admitted_by_predicted_bytes(tiny_dir):
    # 1000x1000 predicts ~12 MiB with the torchvision backend: over a 1 MiB budget, so
    # each image decodes alone although four preprocessing threads are free.
    limits = replace(LimitsConfig(), max_decoded_mb=1)
    server = Server(serve_config(tiny_dir, limits=limits, preprocess_workers=4)).start()
    try:
        pre, lock = server.runtime.preprocessor, threading.Lock()
        real, running, seen, overlap = pre.stage, [0], [0], threading.Event()

        def stage(image, **kw):
            with lock:
                running[0] += 1
                seen[0] = max(seen[0], running[0])
                if running[0] > 1:
                    overlap.set()
            try:
                overlap.wait(0.5)  # gives a second decode the chance to start beside this one
                return real(image, **kw)
            finally:
                with lock:
                    running[0] -= 1

        pre.stage = stage
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/encode", json=body(*(flat_png(i, (1000, 1000)) for i in range(4))))
            assert r.status_code == 200, r.text
            assert seen[0] == 1 and not overlap.is_set()
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
