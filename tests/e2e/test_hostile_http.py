# SPDX-License-Identifier: Apache-2.0
"""Slow and silent sockets are closed past their timeouts, while /health stays responsive:
slow heads, slow bodies, silent and idle sockets, and bodies on methods that take none.
The states behind these deadlines and their transitions: test_hostile_connections.py."""

from __future__ import annotations

import threading
import time

import pytest

from epd_encoder.config import HttpConfig
from tests.e2e.harness import Server, serve_config
from tests.e2e.hostile import (BODIES, HealthProbe, connect, open_with_body, read_response, read_until_closed,
                               status_of, trickle)

HEAD_S, BODY_S, IDLE_S = 1.0, 1.5, 1.0
SLACK = 2.0  # two loaded cores: a timer may fire late, never early
HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 400 + b"\r\n\r\n"


@pytest.fixture(scope="module")
def strict(tiny_dir):
    http = HttpConfig(header_timeout=HEAD_S, body_timeout=BODY_S, keep_alive_timeout=IDLE_S)
    s = Server(serve_config(tiny_dir, http=http)).start()
    yield s
    s.stop()


def _slowly(sock, data: bytes, every: float = 0.05) -> tuple[bytes, float | None]:
    stop = threading.Event()
    feeder = threading.Thread(target=trickle, args=(sock, data, every, stop), daemon=True)
    feeder.start()
    try:
        return read_until_closed(sock, timeout=HEAD_S + BODY_S + 3 * SLACK)
    finally:
        stop.set()
        feeder.join(5)


def test_a_header_trickle_is_closed_at_the_head_deadline(strict):
    """Slowloris: 400+ header bytes at 20 bytes/s would take 20 s; the server cuts it at 1 s."""
    with HealthProbe(strict.url) as probe:
        s = connect(strict.url)
        try:
            data, held = _slowly(s, HEAD)
        finally:
            s.close()
    print(f"\n[slowloris] header trickle held {held:.2f} s (header_timeout {HEAD_S} s)")
    assert held is not None and HEAD_S * 0.9 <= held < HEAD_S + SLACK, held
    assert status_of(data) == 408, data[:200]
    probe.check(name="header trickle")


def test_a_trickled_head_after_a_keep_alive_request_is_bounded_too(strict):
    s = connect(strict.url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(read_response(s)) == 200
        data, held = _slowly(s, HEAD)
    finally:
        s.close()
    assert held is not None and held < HEAD_S + SLACK, held
    assert status_of(data) == 408


def test_a_silent_socket_is_closed(strict):
    with HealthProbe(strict.url) as probe:
        s = connect(strict.url)
        try:
            data, held = read_until_closed(s, timeout=HEAD_S + 3 * SLACK)
        finally:
            s.close()
    assert held is not None and held < HEAD_S + SLACK, held
    assert data == b""  # nothing was asked, so nothing is answered
    probe.check(name="silent socket")


def test_a_body_trickle_gets_408_at_the_body_deadline(strict):
    with HealthProbe(strict.url) as probe:
        s = connect(strict.url)
        try:
            t0 = time.monotonic()
            s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 2000\r\n\r\n")
            data, _ = _slowly(s, b"{" * 2000)
            held = time.monotonic() - t0
        finally:
            s.close()
    print(f"\n[body trickle] held {held:.2f} s (body_timeout {BODY_S} s)")
    assert status_of(data) == 408, data[:200]
    assert b"body_timeout" in data
    assert BODY_S * 0.9 <= held < BODY_S + SLACK, held
    probe.check(name="body trickle")


def test_an_idle_keep_alive_connection_is_closed(strict):
    s = connect(strict.url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(read_response(s)) == 200
        data, held = read_until_closed(s, timeout=IDLE_S + 3 * SLACK)
    finally:
        s.close()
    assert held is not None and held < IDLE_S + SLACK, held
    assert data == b""


@pytest.mark.parametrize("kind", sorted(BODIES))
@pytest.mark.parametrize("method", [b"GET", b"HEAD", b"OPTIONS"])
def test_a_body_on_a_method_that_takes_none_gets_400_and_the_connection_closes(strict, method, kind):
    """/health answered 200 without reading the body, and each trickled body byte cancelled
    the keep-alive timer with nothing to replace it: the socket was held for ever."""
    with HealthProbe(strict.url) as probe:
        s = open_with_body(strict.url, method, kind)
        try:
            data, held = _slowly(s, BODIES[kind][2])
        finally:
            s.close()
    assert held is not None, f"{method.decode()} with a {kind} body was never closed"
    assert held < BODY_S + SLACK, held
    assert status_of(data) == 400, data[:200]
    assert b"connection: close" in data.lower()
    if method != b"HEAD":  # a HEAD answer has no body
        assert b"body_not_allowed" in data
    probe.check(name=f"{method.decode()} with a {kind} body")
