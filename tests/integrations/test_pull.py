# SPDX-License-Identifier: Apache-2.0
"""fetch_rows, the connector's pull, against a real server and against a tier that is down,
slow, or has lost the key: each ends in UnavailableItem naming why, within the timeout."""

from __future__ import annotations

import base64
import socket
import threading
import time

import httpx
import pytest
import torch

from epd_encoder.integrations.pull import UnavailableItem, fetch_rows
from epd_encoder.wire import unpack_item
from epd_encoder.models.tiny import write_tiny_model
from tests.e2e.harness import Server, png, serve_config


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(serve_config(write_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "m"))).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def pulled(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/encode", json={"items": [{"type": "image", "image": base64.b64encode(png(3)).decode()}],
                                       "delivery": {"mode": "pull"}})
        r.raise_for_status()
        key = r.json()["items"][0]["key"]
        return key, unpack_item(c.get(f"/v1/embeddings/{key}").content)[2]


def test_fetch_gives_the_items_rows(server, pulled):
    key, output = pulled
    assert torch.equal(fetch_rows(server.url, key, timeout=30), output.embedding)


def test_lost_key_names_the_status(server):
    with pytest.raises(UnavailableItem, match="answered 404"):
        fetch_rows(server.url, "0" * 64, timeout=30)


def test_down_tier_is_unavailable_at_once():
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(UnavailableItem, match="unreachable or slow"):
            fetch_rows(url, "0" * 64, timeout=30)


def test_slow_tier_is_unavailable_after_the_timeout():
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    accepted = threading.Event()

    def hold() -> None:  # accept, read nothing, answer nothing
        held.append(listener.accept()[0])
        accepted.set()

    threading.Thread(target=hold, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(UnavailableItem, match="timed out"):
            fetch_rows(f"http://127.0.0.1:{listener.getsockname()[1]}", "0" * 64, timeout=0.5)
        assert accepted.is_set()
        assert time.monotonic() - t0 >= 0.5
    finally:
        listener.close()
        for c in held:
            c.close()


def test_a_uuid_that_is_no_path_segment_is_asked_for_whole():
    """vLLM's identifier is the client's uuid, any string: it travels as one escaped segment."""
    listener = socket.create_server(("127.0.0.1", 0))
    lines: list[bytes] = []

    def answer_404() -> None:
        conn = listener.accept()[0]
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
            lines.append(head.split(b"\r\n", 1)[0])
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    thread = threading.Thread(target=answer_404, daemon=True)
    thread.start()
    try:
        with pytest.raises(UnavailableItem, match="answered 404"):
            fetch_rows(f"http://127.0.0.1:{listener.getsockname()[1]}", "a/../b?c#d e", timeout=30)
        thread.join(30)
        assert lines == [b"GET /v1/embeddings/a%2F..%2Fb%3Fc%23d%20e HTTP/1.1"]
    finally:
        listener.close()
