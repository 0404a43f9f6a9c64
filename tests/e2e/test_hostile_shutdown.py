# SPDX-License-Identifier: Apache-2.0
"""SIGTERM with a slow uploader: the half-sent body gets 503 at once, shutdown is prompt."""

from __future__ import annotations

import signal
import threading
import time

import httpx

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
        assert s.proc.wait(DRAIN_S) in (0, -signal.SIGTERM)
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
