# SPDX-License-Identifier: Apache-2.0
"""SIGTERM: a half-sent body gets 503 at once, shutdown is prompt, and every connection the
server took (under load, or still in its listen queue) gets an HTTP answer."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.harness import body, png
from tests.e2e.hostile import ServerProcess, connect, read_until, read_until_closed, status_of, trickle


DRAIN_S = 20


def test_sigterm_does_not_wait_for_a_half_sent_body(tiny_dir):
    s = ServerProcess(tiny_dir, "--drain-timeout", str(DRAIN_S))
    up = None
    stop = threading.Event()
    try:
        s.wait_ready()
        with httpx.Client(base_url=s.url, timeout=30) as c:  # accepted work before still succeeds
            assert c.post("/v1/encode", json=body(png(31))).status_code == 200
        up = connect(s.url)
        # Expect: 100-continue makes the server say when the app starts reading the body, so
        # the signal lands on a request being uploaded, never on headers not yet parsed.
        up.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 100000\r\nExpect: 100-continue\r\n\r\n")
        interim, _ = read_until(up, b"\r\n\r\n", timeout=DRAIN_S)
        assert interim.startswith(b"HTTP/1.1 100"), interim[:200]
        threading.Thread(target=trickle, args=(up, b"{" * 100000, 0.05, stop), daemon=True).start()
        logged = len(s.lines)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        data, closed_after = read_until_closed(up, timeout=DRAIN_S)
        assert status_of(data) == 503 and b"shutting down" in data, data[:300]
        assert closed_after is not None
        assert s.proc.wait(DRAIN_S) == 0
        took = time.monotonic() - t0
    finally:
        stop.set()
        if up is not None:
            up.close()
        s.close()
    print(f"\n[shutdown] SIGTERM to exit with a slow uploader: {took:.2f} s (drain timeout {DRAIN_S} s)")
    assert took < 5, took
    tail = "".join(s.lines[logged:])
    assert "Traceback" not in tail and "Cancel" not in tail, tail[-2000:]


def _client(url: str, request: bytes, outcomes: list, answered: threading.Semaphore) -> None:
    """New connections, one request each, until the server refuses to connect."""
    while True:
        try:
            sock = connect(url, timeout=DRAIN_S)
        except ConnectionRefusedError:
            return outcomes.append("refused")
        except OSError as e:  # a connect that timed out: the server neither took nor refused it
            return outcomes.append(f"connect failed: {e!r}")
        with sock:
            try:
                sock.sendall(request)
                data, _ = read_until_closed(sock, timeout=DRAIN_S)
            except OSError as e:
                data = repr(e).encode()
        status = status_of(data)
        outcomes.append(status if status is not None else f"no answer: {data[:120]!r}")
        answered.release()


def _under_load(s: ServerProcess, stop_it, rc: int) -> list:
    """12 clients on new connections until the server refuses them; ``stop_it`` once 24 are
    answered. Every connection the server took must have had an HTTP answer."""
    outcomes: list = []
    answered = threading.Semaphore(0)
    payload = json.dumps(body(png(5))).encode()
    request = (b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    s.wait_ready()
    clients = [threading.Thread(target=_client, args=(s.url, request, outcomes, answered), daemon=True)
               for _ in range(12)]
    for t in clients:
        t.start()
    for _ in range(24):  # the stop lands on a server busy with encodes and connects
        assert answered.acquire(timeout=60), outcomes
    stop_it()
    for t in clients:
        t.join(3 * DRAIN_S)
    assert s.proc.wait(DRAIN_S) == rc, "".join(s.lines[-20:])
    unanswered = [o for o in outcomes if isinstance(o, str) and o != "refused"]
    assert not unanswered, (unanswered, "".join(s.lines[-20:]))
    assert outcomes.count("refused") == 12, outcomes
    return outcomes


def test_sigterm_under_load_answers_every_connection_it_took(tiny_dir):
    s = ServerProcess(tiny_dir, "--drain-timeout", str(DRAIN_S))
    try:
        outcomes = _under_load(s, lambda: s.proc.send_signal(signal.SIGTERM), rc=0)
    finally:
        s.close()
    assert set(outcomes) <= {200, 503, "refused"}, outcomes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rank groups need Linux's prctl")
def test_a_rank_killed_under_load_leaves_no_connection_unanswered(tiny_dir):
    import psutil

    s = ServerProcess(tiny_dir, "--tp", "2", "--tp-mode", "data", "--drain-timeout", str(DRAIN_S))
    try:
        outcomes = _under_load(s, lambda: psutil.Process(s.proc.pid).children()[0].kill(), rc=1)
    finally:
        s.close()
    assert set(outcomes) <= {200, 503, "refused"} and 503 in outcomes, outcomes  # 503 rank_failed


def test_connections_taken_before_sigterm_get_an_answer_when_their_request_comes_after(tiny_dir):
    s = ServerProcess(tiny_dir, "--drain-timeout", str(DRAIN_S))
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    socks = []
    try:
        s.wait_ready()
        s.proc.send_signal(signal.SIGSTOP)  # the kernel completes these handshakes; the server sees none
        try:
            socks = [connect(s.url) for _ in range(6)]
            s.proc.send_signal(signal.SIGTERM)
        finally:
            s.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + DRAIN_S
        while not any("Shutting down" in line for line in s.lines):
            assert time.monotonic() < deadline and s.proc.poll() is None, "".join(s.lines[-20:])
            time.sleep(0.01)
        answers = []
        for sock in socks:  # requests sent once the shutdown has begun, on connections it took
            try:
                sock.sendall(request)
                data, _ = read_until_closed(sock, timeout=DRAIN_S)
            except OSError as e:
                data = repr(e).encode()
            answers.append(status_of(data) or data[:120])
        assert answers == [200] * len(socks), answers
        assert s.proc.wait(DRAIN_S) == 0
    finally:
        for sock in socks:
            sock.close()
        s.close()
