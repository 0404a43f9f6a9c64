# SPDX-License-Identifier: Apache-2.0
"""Hostile bodies and paths: refused within bounded event-loop time, memory and error-body size."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.e2e.harness import body, png, wait_for

MiB = 1 << 20
ERROR_BODY_BOUND = 4096


class HealthProbe:
    """Polls /health from its own thread and records each answer's latency, and the RSS it sees."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self.peak_rss = url, [], _rss()
        self.stop, self.polled = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = c.get("/health").status_code == 200
                except httpx.TimeoutException:
                    ok = False
                self.latencies.append(time.monotonic() - t0 if ok else float("inf"))
                self.peak_rss = max(self.peak_rss, _rss())
                if len(self.latencies) >= 3:
                    self.polled.set()

    def __enter__(self) -> "HealthProbe":
        self.thread.start()
        assert self.polled.wait(20), "the probe never got three answers"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _rss() -> int:
    """This process's resident set, in bytes: the server runs in-process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _post_raw(client: httpx.Client, raw: bytes) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = client.post("/v1/encode", content=raw, headers={"content-type": "application/json"})
    return r, time.monotonic() - t0


def _list_of(element: bytes, size: int, head: bytes = b'{"items":[', tail: bytes = b"]}") -> bytes:
    n = (size - len(head) - len(tail)) // (len(element) + 1)
    return head + b",".join([element] * n) + tail


HUGE_LISTS = {
    "ints": (_list_of(b"1", 4 * MiB), {422}),
    "well-formed items": (_list_of(b'{"type":"image","image":""}', 4 * MiB), {413}),
    "unknown item types": (_list_of(b'{"type":"video"}', 4 * MiB), {413}),
    "chat parts": (_list_of(b'{"type":"image_url","image_url":"x"}', 4 * MiB,
                            b'{"messages":[{"role":"user","content":[', b"]}]}"), {413}),
    "text parts": (_list_of(b'{"type":"text","text":"hi"}', 4 * MiB,
                            b'{"messages":[{"role":"user","content":[', b"]}]}"), {413}),
    "messages": (_list_of(b'{"role":"user","content":"hi"}', 4 * MiB, b'{"messages":['), {413}),
    # Past MAX_JSON_VALUES: the duplicate-key check would build it (api/parse.py).
    "ignored nesting": (_list_of(b"[]", 4 * MiB, b'{"items":[{"type":"image","image":"AAAA"}],"x":['), {413}),
}


@pytest.mark.parametrize("case", list(HUGE_LISTS))
def test_a_4_mib_list_is_refused_promptly_while_health_answers(server, client, case):
    raw, statuses = HUGE_LISTS[case]
    with HealthProbe(server.url) as probe:
        rss0 = probe.peak_rss
        r, took = _post_raw(client, raw)
        polls = len(probe.latencies)
        assert wait_for(lambda: len(probe.latencies) >= polls + 3)  # a few answers after the refusal too
    assert r.status_code in statuses, r.text[:300]
    assert len(r.content) < ERROR_BODY_BOUND
    assert took < 5.0, f"{took:.1f} s to refuse {len(raw)} bytes"
    assert probe.p99() < 0.5, f"/health p99 {probe.p99():.2f} s over {len(probe.latencies)} polls"
    assert probe.peak_rss - rss0 < 200 * MiB, f"RSS grew by {(probe.peak_rss - rss0) / MiB:.0f} MiB"
    assert client.post("/v1/encode", json=body(png(5, (56, 56)))).status_code == 200


def test_a_50_mb_item_type_gets_a_small_error_promptly(server, client):
    raw = json.dumps({"items": [{"type": "v" * 50_000_000}]}).encode()
    with HealthProbe(server.url) as probe:
        r, took = _post_raw(client, raw)
    assert r.status_code == 415, r.text[:300]
    assert r.json()["error"]["code"] == "unsupported_media"
    assert len(r.content) < ERROR_BODY_BOUND and "vvvv" in r.json()["error"]["message"]
    assert took < 10.0 and probe.p99() < 0.5, (took, probe.p99())


def _get_raw(url: str, path: str) -> tuple[int, bytes]:
    """GET over a plain socket: httpx refuses URLs over 64 KiB, a hostile client does not."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


@pytest.mark.parametrize("size", [12_000, 70_000])
@pytest.mark.parametrize("path,status,code", [
    ("/v1/embeddings/{}", 422, "schema_error"),  # a key is 64 hex digits: refused by the route's pattern
    ("/v1/rooms/{}?receiver=tcp://127.0.0.1:1", 404, "not_found"),
])
def test_a_long_key_is_not_echoed_in_full(server, path, status, code, size):
    got, payload = _get_raw(server.url, path.format("k" * size))
    assert got == status and len(payload) < ERROR_BODY_BOUND, (got, len(payload))
    err = json.loads(payload)["error"]
    assert err["code"] == code and "k" * (size // 2) not in err["message"]


@pytest.mark.parametrize("tail,where", [
    (b'"delivery":{"mode":"push"},"delivery":{"mode":"inline"}', "duplicate key 'delivery'"),
    (b'"video_options":{"fps":"2"}', "video_options.fps: "),
    (b'"video_options":{"fps":true}', "video_options.fps: "),
    (b'"min_pixels":"3136"', "min_pixels: "),
])
def test_duplicate_keys_and_loosely_typed_numbers_get_422(client, tail, where):
    image = json.dumps(body(png(6, (56, 56)))["items"]).encode()
    r, _ = _post_raw(client, b'{"items":' + image + b"," + tail + b"}")
    assert r.status_code == 422 and r.json()["error"]["code"] == "schema_error", r.text[:300]
    assert where in r.json()["error"]["message"], r.text[:300]
