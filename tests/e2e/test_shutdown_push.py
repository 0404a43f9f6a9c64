# SPDX-License-Identifier: Apache-2.0
"""SIGTERM to a real server process: push rooms accepted before it still reach their receiver."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest
import torch

from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer.messages import WireItem, layout
from tests.e2e.harness import body, png, wait_for
from tests.e2e.hostile import ServerProcess

FLUSHING = "open push room"  # PushSender.close logs it while it lets open rooms finish


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
            assert wait_for(lambda: serving.logged(FLUSHING) or rx.poll("drain") == "failed", timeout=30), \
                "".join(serving.lines[-30:])
            want = hog[0].embedding.clone()
            rx.release("hog")
            got = rx.wait("drain", timeout=20)
    assert torch.equal(got[0].embedding, want) and got[0].key == info["key"]
    # uvicorn re-raises the signal once its graceful shutdown is done.
    assert serving.proc.wait(30) == 0  # a drained SIGTERM exits 0 (docs/operations.md)
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
                assert wait_for(lambda: not s.runtime.ready, timeout=10)  # the stop has begun
            got = rx.wait("queued", timeout=20)
            assert got[0].key == r.json()["items"][0]["key"]
    finally:
        if stopper.ident is None:
            stopper.start()
        stopper.join(30)
    assert not s.runtime.engine.running
