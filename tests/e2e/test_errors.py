# SPDX-License-Identifier: Apache-2.0
"""Every error class of the table, over real HTTP, with the server healthy after each."""

from __future__ import annotations

import io
import struct
import threading
import time
import zlib
from dataclasses import replace

import httpx
import numpy as np
import pytest
from PIL import Image

from epd_encoder.config import AuthConfig, EngineConfig, LimitsConfig
from tests.e2e.harness import Server, body, png, serve_config, wait_for

KEY = "sekrit-token"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 3.0  # the strict server's request timeout: what a 504 costs, and a loaded CPU's headroom


@pytest.fixture(scope="module")
def strict(tiny_dir):
    cfg = serve_config(
        tiny_dir,
        limits=LimitsConfig(max_items=4, max_image_bytes=60_000, max_image_pixels=2_000_000),
        auth=AuthConfig(api_key=KEY, protect_metrics=True),
        engine=replace(EngineConfig(), max_pending_cost=40),
        max_body_mb=1, request_timeout=TIMEOUT,
    )
    s = Server(cfg).start()
    yield s
    s.stop()


@pytest.fixture
def c(strict):
    with httpx.Client(base_url=strict.url, timeout=30, headers=AUTH) as cl:
        yield cl
        assert cl.get("/health").status_code == 200  # the server keeps serving
        assert cl.post("/v1/encode", json=body(png(7, (56, 56)))).status_code == 200


def png_declaring(width: int, height: int) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def expect(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"code", "message"} and err["message"]
    if code:
        assert err["code"] == code


def test_400_undecodable_and_bad_base64(c):
    expect(c.post("/v1/encode", json={"items": [{"type": "image", "image": "%%%not-base64"}]}), 400, "invalid_base64")
    expect(c.post("/v1/encode", json=body(png(1)[:200])), 400, "undecodable_image")
    expect(c.post("/v1/encode", json={"items": [{"type": "image_url", "image_url": {"url": "data:image/png,abc"}}]}), 400)


def test_413_bytes_pixels_items_and_body(c):
    big = np.random.default_rng(0).integers(0, 255, (200, 200, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(big).save(buf, "PNG")
    expect(c.post("/v1/encode", json=body(buf.getvalue())), 413, "image_too_large")  # > 60 kB
    expect(c.post("/v1/encode", json=body(png_declaring(30_000, 30_000))), 413, "image_too_large")
    expect(c.post("/v1/encode", json=body(*[png(i, (28, 28)) for i in range(5)])), 413, "too_many_items")
    huge = {"items": [{"type": "image", "image": "A" * (1 << 20)}]}
    expect(c.post("/v1/encode", json=huge), 413, "too_large")


def test_415_format_and_item_type(c):
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, "TIFF")
    expect(c.post("/v1/encode", json=body(buf.getvalue())), 415, "unsupported_media")
    expect(c.post("/v1/encode", json={"items": [{"type": "audio", "audio": "x"}]}), 415)
    expect(c.post("/v1/encode", json={"items": [{"type": "video", "video": "x"}]}), 400, "invalid_base64")
    url = {"items": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}
    expect(c.post("/v1/encode", json=url), 415)  # URL fetching is off by default


def test_422_schema(c):
    expect(c.post("/v1/encode", json={"itemz": []}), 422, "schema_error")
    expect(c.post("/v1/encode", json={"items": [{"type": "image"}]}), 422)
    expect(c.post("/v1/encode", content=b"{not json", headers={"content-type": "application/json"}), 422)
    expect(c.post("/v1/encode", json={"items": [], "request_id": "bad id with spaces"}), 422)


def test_409_duplicate_in_flight_id_and_429_overload(strict, c):
    results = {}

    def first():
        results["a"] = c.post("/v1/encode", json=body(png(50, (112, 112)), request_id="same"))

    with strict.paused_engine():
        t = threading.Thread(target=first)
        t.start()
        assert wait_for(lambda: strict.runtime.engine.active_requests == 1)
        expect(c.post("/v1/encode", json=body(png(51), request_id="same")), 409, "duplicate_request")
        r = c.post("/v1/encode", json=body(png(52, (112, 112))))
        expect(r, 429, "overloaded")
        assert r.headers["retry-after"]
    t.join(10)
    assert results["a"].status_code == 200


def test_504_timeout_then_healthy(strict, c):
    with strict.paused_engine():  # held for up to 30 s
        t0 = time.monotonic()
        expect(c.post("/v1/encode", json=body(png(60))), 504, "timeout")
        assert time.monotonic() - t0 < 20  # at its own timeout, not when the engine frees
    assert wait_for(lambda: strict.runtime.engine.active_requests == 0)  # the timed-out request was dropped


def test_503_until_loaded(tiny_dir):
    gate = threading.Event()

    def slow_runtime(config, metrics):
        from epd_encoder.server.runtime import Runtime

        gate.wait(30)
        return Runtime(config, metrics)

    s = Server(serve_config(tiny_dir), make_runtime=slow_runtime).start(wait_ready=False)
    try:
        with httpx.Client(base_url=s.url, timeout=30) as cl:
            expect(cl.get("/health"), 503, "not_ready")
            expect(cl.post("/v1/encode", json=body(png(1))), 503, "not_ready")
            gate.set()
            assert wait_for(lambda: cl.get("/health").status_code == 200, timeout=30)
            assert cl.post("/v1/encode", json=body(png(1))).status_code == 200
    finally:
        gate.set()
        s.stop()


def test_auth(strict):
    with httpx.Client(base_url=strict.url, timeout=30) as anon:
        expect(anon.post("/v1/encode", json=body(png(1))), 401, "unauthorized")
        wrong = anon.post("/v1/encode", json=body(png(1)), headers={"Authorization": "Bearer nope"})
        expect(wrong, 401)
        assert wrong.headers["www-authenticate"] == "Bearer"
        expect(anon.get("/v1/models"), 401)
        expect(anon.get("/metrics"), 401)  # protected in this config
        assert anon.get("/health").status_code == 200  # open by default
        ok = anon.post("/v1/encode", json=body(png(1, (56, 56))), headers=AUTH)
        assert ok.status_code == 200
        assert anon.get("/metrics", headers=AUTH).status_code == 200
