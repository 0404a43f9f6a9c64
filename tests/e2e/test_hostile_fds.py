# SPDX-License-Identifier: Apache-2.0
"""A connection flood under a low open-file limit: 503 at the cap, bounded logs, recovery."""

from __future__ import annotations

import select
import time

import httpx
import pytest

from tests.e2e.harness import wait_for
from tests.e2e.hostile import ServerProcess, connect, read_until_closed, status_of

NOFILE = 128  # the auto cap is 64 connections


@pytest.fixture
def spawn(tiny_dir):
    started = []

    def start(*extra: str) -> ServerProcess:
        s = ServerProcess(tiny_dir, "--header-timeout", "30", *extra, nofile=NOFILE)
        started.append(s)
        s.wait_ready()
        return s

    yield start
    for s in started:
        s.close()


def _flood(url: str, n: int) -> list:
    socks = []
    for _ in range(n):
        try:
            socks.append(connect(url, timeout=2))
        except OSError:
            break
    return socks


def _answer(sock) -> bytes:
    data, _ = read_until_closed(sock, timeout=5)
    return data


def _health_ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_connections_beyond_the_cap_get_503_and_fds_never_run_out(spawn):
    s = spawn()
    logged = len(s.lines)
    socks = _flood(s.url, 150)
    try:
        expected = 150 - 64 - 10  # a few of the server's fds may be client connections too

        def answered() -> list:
            return select.select(socks, [], [], 0)[0]

        assert wait_for(lambda: len(answered()) >= expected, timeout=10)
        readable = answered()
        answers = [_answer(x) for x in readable]
        refused = [a for a in answers if status_of(a) == 503]
        assert len(refused) >= expected, f"{len(refused)} of 150 refused"
        assert all(b"overloaded" in a for a in refused)
        assert len(refused) == len(answers), [a[:80] for a in answers if status_of(a) != 503][:3]
    finally:
        for x in socks:
            x.close()
    assert wait_for(lambda: _health_ok(s.url), timeout=10)
    tail = s.lines[logged:]
    assert not any("Too many open files" in line for line in tail), "".join(tail[-20:])
    assert len(tail) < 50, f"{len(tail)} log lines"


def test_fd_exhaustion_logs_stay_small(spawn):
    """A cap set above the fd limit: accept() fails on every loop turn (160k lines in 5 s
    before); the rate-limited log keeps a handful, and the server recovers."""
    s = spawn("--max-connections", "1000")
    logged = len(s.lines)
    socks = _flood(s.url, 200)
    try:
        assert wait_for(lambda: any("Too many open files" in line for line in s.lines[logged:]), timeout=10)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # fds stay exhausted: health cannot even be accepted
            assert not _health_ok(s.url)
    finally:
        for x in socks:
            x.close()
    assert wait_for(lambda: _health_ok(s.url), timeout=10)
    tail = s.lines[logged:]
    print(f"\n[fd exhaustion] {len(tail)} log lines, {sum(map(len, tail))} bytes in ~3 s")
    assert len(tail) < 200, f"{len(tail)} log lines"
