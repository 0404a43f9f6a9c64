# SPDX-License-Identifier: Apache-2.0
"""Client disconnects cancel queued work; shutdown drains in-flight requests."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
import torch

from epd_encoder.preprocess.decode import decode_image
from epd_encoder.preprocess.keys import KeyContext
from epd_encoder.receiver import EmbeddingReceiver
from tests.e2e.harness import Server, body, delta, png, scrape, serve_config, wait_for


CANCELLED = ("epd_requests_total", frozenset({("route", "/v1/encode"), ("status", "499")}))


def test_disconnect_cancels_pending_items(tiny_dir):
    s = Server(serve_config(tiny_dir)).start()
    try:
        rt = s.runtime
        data = png(900, (140, 140))
        ctx = KeyContext(model_id=rt.key_identity, revision=rt.revision, params=rt.preprocessor.resolve())
        with httpx.Client(base_url=s.url, timeout=30) as c:
            before = scrape(c)
            with s.paused_engine():
                payload = json.dumps(body(data)).encode()
                host, port = s.url.removeprefix("http://").split(":")
                sock = socket.create_connection((host, int(port)))
                sock.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
                assert wait_for(lambda: rt.engine.active_requests == 1)
                sock.close()  # the client goes away while its item is queued
                # The server noticed (and posted the cancel) while the engine was still busy.
                assert wait_for(lambda: scrape(c).get(CANCELLED, 0) - before.get(CANCELLED, 0) == 1)
                assert delta(c, before, "epd_requests_total", route="/v1/encode", status="499") == 1
            assert wait_for(lambda: rt.engine.active_requests == 0)
            assert ctx.key(data) not in rt.cache  # never encoded
            assert c.post("/v1/encode", json=body(data)).status_code == 200
    finally:
        s.stop()


def refuses_connections(server) -> bool:
    """The listener is closed: a connect fails, or one the kernel had already queued
    is closed unanswered as the server stops accepting."""
    try:
        httpx.get(f"{server.url}/health", timeout=5)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False


def test_shutdown_drains_in_flight_inline_requests(tiny_dir):
    s = Server(serve_config(tiny_dir)).start()
    results: list[int] = []

    def send(i):
        r = httpx.post(f"{s.url}/v1/encode", json=body(png(700 + i)), timeout=60)
        results.append(r.status_code)

    with s.paused_engine():
        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert wait_for(lambda: s.runtime.engine.active_requests == 3)
        stopper = threading.Thread(target=s.stop)
        stopper.start()
        # Shutdown has begun (the listener is closed) while the work is still queued.
        assert wait_for(lambda: refuses_connections(s))
        assert results == [] and s.runtime.engine.active_requests == 3
    for t in threads:
        t.join(30)
    stopper.join(30)
    assert results == [200, 200, 200]
    assert not s.runtime.engine.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{s.url}/health", timeout=2)


def test_shutdown_drains_queued_push_deliveries(tiny_dir):
    s = Server(serve_config(tiny_dir)).start()
    images = [png(720), png(721, (56, 200))]
    rt = s.runtime
    want = [rt.executor.encode([rt.preprocessor.preprocess(decode_image(d, rt.front.decode_limits))])[0]
            for d in images]
    with EmbeddingReceiver(backend="tcp") as rx:
        with s.paused_engine():
            r = httpx.post(f"{s.url}/v1/encode", json=body(*images, delivery=rx.delivery("drain")), timeout=30)
            assert r.status_code == 202, r.text  # answered: only the engine still owes this request
            stopper = threading.Thread(target=s.stop)
            stopper.start()
            # The runtime's drain has begun (no longer ready) while the items are still queued.
            assert wait_for(lambda: not rt.ready)
            assert rt.engine.active_requests == 1 and rx.poll("drain") == "pending"
        items = rx.wait("drain", timeout=30)
        stopper.join(30)
    assert [it.key for it in items] == [it["key"] for it in r.json()["items"]]
    for got, ref in zip(items, want):
        torch.testing.assert_close(got.embedding, ref.embedding, atol=1e-5, rtol=0)
    assert not rt.engine.running
