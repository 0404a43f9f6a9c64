# SPDX-License-Identifier: Apache-2.0
"""Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects)."""

from __future__ import annotations

import json
from typing import Any, Callable

from epd_encoder.api.errors import error_body
from epd_encoder.api.metrics import Metrics

Scope = dict[str, Any]


class BodyLimit:
    """Refuse a body over ``max_bytes`` with 413, by Content-Length or while it streams.

    The body is read here, before the app runs (FastAPI buffers it anyway), and
    replayed as one message; later messages (the disconnect) pass through.
    """

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _too_large(send, self.max_bytes)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected mid-body: nothing to answer
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await _too_large(send, self.max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)


async def _too_large(send: Callable, limit: int) -> None:
    body = json.dumps(error_body("too_large", f"the request body is over {limit} bytes")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestMetrics:
    """Counts finished requests by route template and status."""

    def __init__(self, app: Callable, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def capture(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, str(status["code"])).inc()
