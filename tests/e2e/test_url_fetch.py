# SPDX-License-Identifier: Apache-2.0
"""http(s) image URLs through the real server: off by default, SSRF-safe when on."""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

from epd_encoder.api.fetch import UrlFetcher
from epd_encoder.config import FetchConfig
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, body, png, serve_config

IMAGE = png(42, (84, 112))


@pytest.fixture(scope="module")
def origin():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            self.wfile.write(IMAGE)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/img.png"
    httpd.shutdown()


def url_body(url):
    return {"items": [{"type": "image_url", "image_url": {"url": url}}]}


def test_url_fetch_blocks_private_addresses_and_fetches_allowed_ones(tiny_dir, origin):
    s = Server(serve_config(tiny_dir, fetch=replace(FetchConfig(), allow_url_fetch=True))).start()
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            blocked = c.post("/v1/encode", json=url_body(origin))
            assert blocked.status_code == 400 and "not allowed" in blocked.json()["error"]["message"]
            meta = c.post("/v1/encode", json=url_body("http://169.254.169.254/latest/meta-data/"))
            assert meta.status_code == 400
            # An operator policy admitting exactly this loopback origin (tests only).
            s.runtime.front.fetcher = UrlFetcher(
                max_bytes=1 << 20, connect_timeout_s=2, total_timeout_s=5,
                address_policy=lambda ip: ip == ipaddress.ip_address("127.0.0.1"))
            ok = c.post("/v1/encode", json=url_body(origin))
            assert ok.status_code == 200
            _, items = unpack_inline(ok.content)
            inline = c.post("/v1/encode", json=body(IMAGE))
            _, same = unpack_inline(inline.content)
            assert same[0][0].key == items[0][0].key and same[0][0].cache == "hit"
            torch.testing.assert_close(same[0][1].embedding, items[0][1].embedding, atol=0, rtol=0)
    finally:
        s.stop()


def test_video_urls_are_fetched_under_the_video_byte_limit_and_blocked_like_images(tiny_dir):
    from epd_encoder.config import VideoConfig
    from epd_encoder.errors import VideoTooLarge
    from tests.e2e.videos import video

    clip = video(12, seed=44)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(clip)))
            self.end_headers()
            self.wfile.write(clip)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/clip.mp4"
    part = {"items": [{"type": "video_url", "video_url": {"url": url}}]}
    s = Server(serve_config(tiny_dir, fetch=replace(FetchConfig(), allow_url_fetch=True),
                            video=VideoConfig(max_video_bytes=len(clip)))).start()
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            blocked = c.post("/v1/encode", json=part)
            assert blocked.status_code == 400 and "not allowed" in blocked.json()["error"]["message"]
            loopback = UrlFetcher(max_bytes=1 << 20, connect_timeout_s=2, total_timeout_s=5,
                                  address_policy=lambda ip: ip == ipaddress.ip_address("127.0.0.1"))
            fetchers = {"image": loopback, "video": loopback.limited(len(clip), VideoTooLarge)}
            s.runtime.front.fetcher = fetchers
            ok = c.post("/v1/encode", json=part)
            assert ok.status_code == 200, ok.text
            (meta, _), = unpack_inline(ok.content)[1]
            assert meta.modality == "video" and meta.grid_thw[0] > 1
            fetchers["video"] = loopback.limited(len(clip) - 1, VideoTooLarge)
            over = c.post("/v1/encode", json=part)
            assert over.status_code == 413 and over.json()["error"]["code"] == "video_too_large"
    finally:
        s.stop()
        httpd.shutdown()


def test_serve_flags_fetch_from_a_private_address_only_when_allowed(tiny_dir, origin):
    # `epd-encoder serve` itself: the flags reach the fetcher. 127.0.0.1 stands for an in-cluster store.
    from tests.e2e.hostile import ServerProcess

    port = httpx.URL(origin).port
    for flags, allowed in ((("--allow-url-fetch",), False),
                           (("--allow-url-fetch", "--fetch-allow-private", "--fetch-allow-hosts", "127.0.0.1"), True)):
        s = ServerProcess(tiny_dir, *flags)
        try:
            s.wait_ready()
            with httpx.Client(base_url=s.url, timeout=30) as c:
                r = c.post("/v1/encode", json=url_body(origin))
                if allowed:
                    assert r.status_code == 200, r.text
                    assert unpack_inline(r.content)[1][0][0].num_tokens > 0
                else:
                    assert r.status_code == 400 and "non-public address" in r.json()["error"]["message"], r.text
                # Never the metadata endpoint; never a host outside --fetch-allow-hosts.
                for url in ("http://169.254.169.254/latest/meta-data/", f"http://localhost:{port}/img.png"):
                    refused = c.post("/v1/encode", json=url_body(url))
                    assert refused.status_code == 400 and "not allowed" in refused.json()["error"]["message"]
        finally:
            s.close()
