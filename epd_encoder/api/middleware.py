# SPDX-License-Identifier: Apache-2.0
"""Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects)."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any, Callable

from epd_encoder.api.errors import error_response
from epd_encoder.api.metrics import Metrics
from epd_encoder.errors import BodyNotAllowed, BodyTimeout, EncoderError, NotReady, TooLarge, Unauthorized

Scope = dict[str, Any]
# Methods whose requests carry no content in this API (RFC 9110 gives a GET body no meaning).
NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})


def _has_body(scope: Scope) -> bool:
    headers = dict(scope.get("headers") or ())
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") not in (b"0", b"")


async def refuse(scope: Scope, send: Callable, exc: EncoderError) -> None:
    """Answer ``exc`` (mapped in api/errors.py) without reading the rest of the body.

    A body left unread is dropped with the connection (``Connection: close``), as nginx
    does, rather than read and discarded for a client that may never finish sending it.
    """
    response = error_response(exc)
    if _has_body(scope):
        response.headers["connection"] = "close"
    await response(scope, _no_receive, send)


async def _no_receive() -> dict:
    raise RuntimeError("an error response never reads the request")


class BearerAuth:
    """Refuse a request without ``Authorization: Bearer <key>`` on its headers alone,
    before any of its body is read; paths in ``open_paths`` need no key."""

    def __init__(self, app: Callable, key: str, open_paths: frozenset[str]) -> None:
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            return await self.app(scope, receive, send)
        await refuse(scope, send, Unauthorized("a valid 'Authorization: Bearer <key>' header is required"))

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        # compare_digest runs in time independent of where the token differs.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


class Drain:
    """Set once the server begins its graceful shutdown (server/http.py calls ``begin``)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def begin(self) -> None:
        self.event.set()


class BodyLimit:
    """Read the whole body before the app runs, within bounds, and replay it as one message.

    Only a route that takes a body (``takes_body``) has one read. Any other request that
    declares one is answered from its headers and its connection closed, so no body is
    ever waited for without a deadline: 400 ``body_not_allowed`` on a method that takes
    none (GET, HEAD, ...), else the app's own answer (405 on /health, 404) to an empty body.
    A body that is read: 413 over ``max_bytes`` (by Content-Length or while it streams),
    408 when it has not all come within ``timeout`` seconds, 503 when a drain begins
    first: at shutdown a half-sent body is refused, not waited for. Later messages (the
    disconnect) pass through.
    """

    def __init__(self, app: Callable, max_bytes: int, timeout: float, drain: Drain | None = None,
                 takes_body: Callable[[Scope], bool] = lambda scope: True) -> None:
        self.app, self.max_bytes, self.timeout, self.drain = app, max_bytes, timeout, drain
        self.takes_body = takes_body

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] in NO_BODY_METHODS or not self.takes_body(scope):
            if not _has_body(scope):
                return await self.app(scope, receive, send)
            if scope["method"] in NO_BODY_METHODS:
                return await refuse(scope, send, BodyNotAllowed(
                    f"a {scope['method']} request takes no body; send none (Content-Length: 0 or no header)"))
            return await self.app(scope, _empty_body(), _closing(send))
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _too_large(scope, send, self.max_bytes)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        draining = asyncio.ensure_future(self.drain.event.wait()) if self.drain is not None else None
        chunks, seen = [], 0
        try:
            while True:
                message = await _receive_until(receive, deadline - loop.time(), draining)
                if message is _DRAINING:
                    return await refuse(scope, send, NotReady("the server is shutting down; retry elsewhere"))
                if message is None:
                    return await refuse(scope, send, BodyTimeout(
                        f"the request body did not arrive within {self.timeout:g} s"))
                if message["type"] != "http.request":  # disconnected mid-body: nothing to answer
                    return
                chunk = message.get("body", b"")
                seen += len(chunk)
                if seen > self.max_bytes:
                    return await _too_large(scope, send, self.max_bytes)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        finally:
            if draining is not None:
                draining.cancel()
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)


_DRAINING = {"type": "epd.draining"}


def _empty_body() -> Callable:
    """A receive for an app answering from the headers: an empty body, then the request is over."""
    replay: list[dict] = [{"type": "http.disconnect"}, {"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict:
        return replay.pop() if len(replay) > 1 else replay[0]
    return receive


def _closing(send: Callable) -> Callable:
    """``send`` with ``Connection: close`` on the answer: the body left unread goes with the connection."""
    async def closing_send(message: dict) -> None:
        headers = list(message.get("headers", ()))
        if message["type"] == "http.response.start" and (b"connection", b"close") not in headers:
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)
    return closing_send


async def _receive_until(receive: Callable, timeout: float, draining: asyncio.Future | None) -> dict | None:
    """The next message; None past ``timeout``; _DRAINING once ``draining`` is done (checked first)."""
    if draining is not None and draining.done():
        return _DRAINING
    pending = asyncio.ensure_future(receive())
    await asyncio.wait([pending] if draining is None else [pending, draining],
                       timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
    if pending.done():
        return pending.result()
    pending.cancel()
    return _DRAINING if draining is not None and draining.done() else None


async def _too_large(scope: Scope, send: Callable, limit: int) -> None:
    await refuse(scope, send, TooLarge(f"the request body is over {limit} bytes"))


class RequestMetrics:
    """Counts finished requests by route template and status, and times them end to end.

    The route is the matched template (``/v1/embeddings/{key}``), never the raw path:
    clients choose paths, so labelling by them would grow series without bound.
    A request that ends unanswered after the client went away (say, mid-body) is 499,
    nginx's "client closed request"; 5xx stays for our own faults.
    """

    def __init__(self, app: Callable, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen: dict[str, Any] = {"status": None, "gone": False}

        async def capture(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            await send(message)

        async def watch():
            message = await receive()
            seen["gone"] |= message["type"] == "http.disconnect"
            return message

        started = time.perf_counter()
        try:
            await self.app(scope, watch, capture)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            status = seen["status"] or (499 if seen["gone"] else 500)
            self.metrics.observe_request(path, scope["method"], status, started)
