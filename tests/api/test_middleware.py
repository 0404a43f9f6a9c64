# SPDX-License-Identifier: Apache-2.0
"""BodyLimit reads a body only for a route that takes one; any other body is refused or left
unread from the headers alone, and its connection closed (docs/operations.md)."""

from __future__ import annotations

import asyncio
import json

from epd_encoder.api.middleware import BodyLimit

TAKES_BODY = {("POST", "/v1/encode")}


def _scope(method: str, path: str, *headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": list(headers)}


class Seen:
    """A downstream app that answers 200 with what it read, and the messages sent upstream."""

    def __init__(self) -> None:
        self.called, self.sent, self.reads = False, [], 0

    async def app(self, scope, receive, send) -> None:
        self.called = True
        message = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": message.get("body", b"")})

    async def send(self, message) -> None:
        self.sent.append(message)

    async def receive(self) -> dict:
        self.reads += 1
        return {"type": "http.request", "body": b"payload", "more_body": False}

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> dict:
        return dict(self.sent[0]["headers"])


def _call(seen: Seen, scope: dict) -> None:
    limit = BodyLimit(seen.app, max_bytes=1 << 20, timeout=5,
                      takes_body=lambda s: (s["method"], s["path"]) in TAKES_BODY)
    asyncio.run(limit(scope, seen.receive, seen.send))


def test_a_body_on_get_is_400_from_the_headers_and_closes():
    for declared in ((b"content-length", b"10"), (b"transfer-encoding", b"chunked")):
        seen = Seen()
        _call(seen, _scope("GET", "/health", declared))
        assert not seen.called and seen.reads == 0
        assert seen.status == 400 and seen.headers[b"connection"] == b"close"
        assert json.loads(seen.sent[1]["body"])["error"]["code"] == "body_not_allowed"


def test_a_get_without_a_body_passes_untouched():
    for headers in ((), ((b"content-length", b"0"),)):
        seen = Seen()
        _call(seen, _scope("GET", "/health", *headers))
        assert seen.called and seen.status == 200 and b"connection" not in seen.headers


def test_a_body_to_a_route_that_takes_none_is_never_read():
    """POST /health with 100 MB declared: the app answers (405 in the real app) to an empty
    body at once, and the connection closes; before, the whole body was buffered first."""
    seen = Seen()
    _call(seen, _scope("POST", "/health", (b"content-length", str(100 << 20).encode())))
    assert seen.called and seen.reads == 0
    assert seen.sent[1]["body"] == b"" and seen.headers[b"connection"] == b"close"


def test_a_body_route_reads_its_body():
    seen = Seen()
    _call(seen, _scope("POST", "/v1/encode", (b"content-length", b"7")))
    assert seen.reads == 1 and seen.sent[1]["body"] == b"payload" and b"connection" not in seen.headers
