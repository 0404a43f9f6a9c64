# SPDX-License-Identifier: Apache-2.0
"""Client disconnects cancel queued work; shutdown drains in-flight requests."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from epd_encoder.preprocess.keys import KeyContext
from tests.e2e.harness import Server, body, metric, png, serve_config


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_disconnect_cancels_pending_items(tiny_dir):
    s = Server(serve_config(tiny_dir)).start()
    try:
        rt = s.runtime
        data = png(900, (140, 140))
        ctx = KeyContext(model_id=rt.model_id, revision=rt.revision, params=rt.preprocessor.resolve())
        with httpx.Client(base_url=s.url, timeout=30) as c:
            before = metric(c, "epd_requests_total", route="/v1/encode", status="499")
            with s.paused_engine():
                payload = json.dumps(body(data)).encode()
                host, port = s.url.removeprefix("http://").split(":")
                sock = socket.create_connection((host, int(port)))
                sock.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
                assert wait_for(lambda: rt.engine.active_requests == 1)
                sock.close()  # the client goes away while its item is queued
                # The server noticed (and posted the cancel) while the engine was still busy.
                assert wait_for(lambda: metric(c, "epd_requests_total", route="/v1/encode",
                                               status="499") == before + 1)
            assert wait_for(lambda: rt.engine.active_requests == 0)
            assert ctx.key(data) not in rt.cache  # never encoded
            assert c.post("/v1/encode", json=body(data)).status_code == 200
    finally:
        s.stop()


def test_shutdown_drains_in_flight_requests(tiny_dir):
    s = Server(serve_config(tiny_dir)).start()
    results: list[int] = []

    def send(i):
        r = httpx.post(f"{s.url}/v1/encode", json=body(png(700 + i)), timeout=30)
        results.append(r.status_code)

    with s.paused_engine():
        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert wait_for(lambda: s.runtime.engine.active_requests == 3)
        stopper = threading.Thread(target=s.stop)
        stopper.start()
        time.sleep(0.3)  # shutdown has begun while the work is still queued
        assert results == []
    for t in threads:
        t.join(30)
    stopper.join(30)
    assert results == [200, 200, 200]
    assert not s.runtime.engine.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{s.url}/health", timeout=2)
