# SPDX-License-Identifier: Apache-2.0
"""Every connection is under one deadline at every moment (docs/operations.md, "Connection
states and timers"): bodies on methods that take none, bodies on open paths, pipelined heads,
and the connection cap, with raw sockets against a real server with every timeout at ~1 s."""

from __future__ import annotations

import re
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from epd_encoder.config import AuthConfig, HttpConfig
from tests.e2e.harness import Server, serve_config
from tests.e2e.hostile import (AUTH, BODIES, KEY, HealthProbe, connect, open_with_body, read_response, read_until,
                               read_until_closed, status_of, trickle)

HEAD_S, BODY_S, IDLE_S = 1.0, 1.0, 1.0
SLACK = 2.0  # two loaded cores: a timer may fire late, never early
WATCH = HEAD_S + BODY_S + IDLE_S + 3 * SLACK  # how long a test waits for a close that must come
SEND_S = 1.0
HTTP = HttpConfig(header_timeout=HEAD_S, body_timeout=BODY_S, keep_alive_timeout=IDLE_S, send_timeout=SEND_S)
BIG = 100 << 20



@pytest.fixture(scope="module")
def strict(tiny_dir):
    s = Server(serve_config(tiny_dir, http=HTTP)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def capped(tiny_dir):
    s = Server(serve_config(tiny_dir, http=HttpConfig(header_timeout=HEAD_S, body_timeout=BODY_S,
                                                      keep_alive_timeout=IDLE_S, max_connections=4))).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(tiny_dir):
    s = Server(serve_config(tiny_dir, http=HTTP, auth=AuthConfig(api_key=KEY))).start()
    yield s
    s.stop()


class Trickler:
    """Sends ``data`` one byte per ``every`` seconds on its own thread, as a client that keeps
    the connection busy (each byte would cancel uvicorn's keep-alive timer)."""

    def __init__(self, sock, data: bytes, every: float = 0.05) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=trickle, args=(sock, data, every, self.stop), daemon=True)

    def __enter__(self) -> "Trickler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)


def statuses(data: bytes) -> list[int]:
    """The status of every response in a stream of them (their bodies are JSON, never a status line)."""
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]


def test_an_empty_body_on_get_is_no_body(strict):
    """Content-Length: 0 declares no body: the request is served and the connection kept."""
    s = connect(strict.url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert status_of(read_response(s)) == 200
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(read_response(s)) == 200
    finally:
        s.close()


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_bodies_on_get_do_not_lock_others_out_at_the_cap(capped, kind):
    """Four trickling GET-with-body sockets under --max-connections 4: every other client was 503."""
    socks = [open_with_body(capped.url, b"GET", kind) for _ in range(4)]
    tricklers = [Trickler(s, BODIES[kind][2]).__enter__() for s in socks]
    try:
        deadline = time.monotonic() + BODY_S + SLACK
        statuses = []
        while time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(f"{capped.url}/health", timeout=5).status_code)
            except httpx.TransportError as e:
                statuses.append(repr(e))
            if statuses[-1] == 200:
                break
            time.sleep(0.05)
        assert statuses and statuses[-1] == 200, statuses[-5:]
    finally:
        for t in tricklers:
            t.__exit__()
        for s in socks:
            s.close()


def test_a_pipelined_get_with_a_body_gets_400_after_the_first_answer(strict):
    s = connect(strict.url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nabcd")
        with Trickler(s, b"x" * 400):
            data, held = read_until_closed(s, timeout=WATCH)
    finally:
        s.close()
    assert held is not None and held < BODY_S + SLACK, held
    assert statuses(data) == [200, 400], data[:400]


def test_a_pipelined_partial_head_is_under_the_head_deadline(strict):
    """Part of a second head sent with the first request: once the first answer is out, the
    connection waits on a head, so the head deadline (408), not the keep-alive close, applies."""
    s = connect(strict.url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nX-Slow: ")
        data, held = read_until_closed(s, timeout=WATCH)
    finally:
        s.close()
    assert held is not None and HEAD_S * 0.9 <= held < HEAD_S + SLACK, held
    assert statuses(data) == [200, 408], data[:400]


def test_pipelined_requests_are_all_answered_then_the_connection_idles_out(strict):
    s = connect(strict.url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        data, held = read_until_closed(s, timeout=WATCH)
    finally:
        s.close()
    assert statuses(data) == [200] * 3, data[:400]
    assert held is not None and IDLE_S * 0.9 <= held < IDLE_S + SLACK, held


def test_a_body_after_a_keep_alive_request_is_under_the_body_deadline(strict):
    """Idle -> head -> body: a POST body trickled on a reused connection gets 408 in time."""
    s = connect(strict.url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(read_response(s)) == 200
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 2000\r\n\r\n")
        t0 = time.monotonic()
        with Trickler(s, b"{" * 2000):
            data, _ = read_until_closed(s, timeout=WATCH)
        held = time.monotonic() - t0
    finally:
        s.close()
    assert status_of(data) == 408, data[:200]
    assert BODY_S * 0.9 <= held < BODY_S + SLACK, held


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_a_body_to_an_open_path_is_refused_from_the_headers(keyed, path):
    """Under --api-key, /health and /metrics need no key; a POST to one declaring 100 MB was
    buffered whole (here: waited for until the body deadline) before its 405."""
    with HealthProbe(keyed.url, AUTH) as probe:
        s = connect(keyed.url)
        try:
            t0 = time.monotonic()
            s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\nabcd" % (path.encode(), BIG))
            head, complete = read_until(s, b"\r\n\r\n", timeout=WATCH)
            answered = time.monotonic() - t0
            data, held = read_until_closed(s, timeout=WATCH)
        finally:
            s.close()
    assert complete and status_of(head) == 405, head[:200]
    assert answered < BODY_S * 0.9, f"answered after {answered:.2f} s: the body was waited for"
    assert b"connection: close" in head.lower() and held is not None
    probe.check(name=f"POST {path} with a body")


def test_an_open_path_still_answers_its_own_method_under_a_key(keyed):
    assert httpx.get(f"{keyed.url}/health", timeout=10).status_code == 200
    assert httpx.post(f"{keyed.url}/health", timeout=10).status_code == 405  # no body: as before


def connect_addr(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _protocol_of(server, sock):
    """The server's protocol object for our end of ``sock`` (the server runs in this process)."""
    ours = sock.getsockname()
    return next((p for p in list(server.server.server_state.connections) if p.client == ours), None)


def test_a_client_that_never_reads_is_aborted_at_the_send_deadline(strict):
    """Pipelined requests whose answers are never read: once our write buffer is full the
    app waits to send, and with nothing taken for --send-timeout the connection is aborted
    (before, it waited for ever, holding its fd, its task and the unsent answers)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(connect_addr(strict.url))
    try:
        s.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 400)
        deadline = time.monotonic() + WATCH
        proto = None
        while time.monotonic() < deadline:  # until the server's buffer is full
            proto = _protocol_of(strict, s)
            if proto is not None and proto.flow.write_paused:
                break
            time.sleep(0.02)
        assert proto is not None and proto.flow.write_paused, "the server's write buffer never filled"
        t0 = time.monotonic()
        while proto in strict.server.server_state.connections and time.monotonic() < t0 + WATCH:
            time.sleep(0.02)
        held = time.monotonic() - t0
    finally:
        s.close()
    assert proto not in strict.server.server_state.connections, f"still open after {WATCH} s"
    assert SEND_S * 0.9 <= held < SEND_S + SLACK, held
