# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder proxy``: vLLM's OpenAI API in front of vLLM, with the media encoded by the
encode tier (docs/proxy.md). Thin and stateless: each chat request's media go to the tier, the
request goes to vLLM rewritten for the mode, and vLLM's answer comes back byte for byte.

Every other route (``/v1/completions``, whose 0.32 schema takes no media, ``/v1/models``,
``/health``, vLLM's extensions) is forwarded unchanged.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from epd_encoder import errors as E
from epd_encoder.client import EncodeResult
from epd_encoder.config.proxy import ProxyConfig
from epd_encoder.integrations.proxy_rewrite import (MediaPart, embeds_part, media_parts, original_part,
                                                    pixel_bounds, rewrite, uuid_part)
from epd_encoder.integrations.proxy_upstream import LLMPool, Unreachable, Upstream

log = logging.getLogger(__name__)

# The openai package's exception names by status (what its clients catch), vLLM's shape otherwise.
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 409: "ConflictError", 422: "UnprocessableEntityError",
          429: "RateLimitError", 499: "ClientClosedRequestError"}


_INLINE_PARSE = 64 << 10  # bytes of JSON parsed on the event loop; above, in a thread


class Encoder(Protocol):
    """The encode tier as the proxy needs it (``epd_encoder.client.AsyncEncodeClient``)."""

    async def encode(self, images: Sequence[Any], *, min_pixels: int | None = None,
                     max_pixels: int | None = None, delivery: Any = "inline") -> EncodeResult: ...


class ProxyError(Exception):
    """An answer the proxy gives itself, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` as vLLM's own errors are shaped
    (``code`` the status); the encode tier's code, when there is one, leads the message."""
    kind = _TYPES.get(status) or http.HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"
    text = f"encode tier: {code}: {message}" if code else message
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse({"error": {"message": text, "type": kind, "param": None, "code": status}},
                        status_code=status, headers=headers)


class Proxy:
    """One request's path: media to the encode tier, the rewritten body to vLLM. The mode's
    delivery and part builder are chosen once, here."""

    def __init__(self, config: ProxyConfig, encoder: Encoder, upstream: Upstream) -> None:
        self.config, self.encoder, self.upstream = config, encoder, upstream
        # embeds: the tensors come back inline; uuid: the tier keeps them for vLLM's connector.
        self.delivery: Any = "inline" if config.mode == "embeds" else config.uuid_delivery

    async def chat(self, request: Request) -> Response:
        raw = await read_body(request, self.config.max_body_mb << 20)
        try:  # media arrive inline: a large body is parsed off the event loop (as the tier does)
            body = json.loads(raw) if len(raw) < _INLINE_PARSE else await asyncio.to_thread(json.loads, raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            body = None  # vLLM answers a malformed body in its own words
        parts = media_parts(body)
        if not parts:  # text only, or nothing this proxy understands: straight through
            return await self.forward(request, raw)
        try:
            result = await asyncio.wait_for(
                self.encoder.encode([p.encode_item() for p in parts], delivery=self.delivery,
                                    **pixel_bounds(body)),
                timeout=self.config.encoder_timeout)
        except (E.EncoderError, asyncio.TimeoutError) as e:
            if self.config.encoder_down == "local" and _is_outage(e):
                log.warning("encode tier unavailable (%s); vLLM encodes this request itself", e)
                return await self.forward(request, raw)
            raise _client_error(e) from e
        if len(result.items) != len(parts):
            raise ProxyError(502, f"the encode tier answered {len(result.items)} items for "
                             f"{len(parts)} media parts")
        new = await asyncio.to_thread(self._rewritten, body, parts, result)
        return await self.forward(request, new)

    def _rewritten(self, body: dict, parts: list[MediaPart], result: EncodeResult) -> bytes:
        built = [embeds_part(item, original_part(body, at)) if self.delivery == "inline"
                 else uuid_part(item.key, original_part(body, at))
                 for at, item in zip(parts, result.items)]
        return json.dumps(rewrite(body, parts, built), separators=(",", ":")).encode()

    async def forward(self, request: Request, body: bytes) -> Response:
        try:
            return await self.upstream.send(request.method, request.url.path, request.url.query,
                                            request.headers, body)
        except Unreachable as e:
            raise ProxyError(503, f"vLLM is unreachable: {e}") from e
        except httpx.TimeoutException as e:
            raise ProxyError(504, f"vLLM did not answer within --llm-timeout ({type(e).__name__})") from e
        except httpx.TransportError as e:  # took the request, then closed or reset before answering
            raise ProxyError(502, f"vLLM failed before answering: {type(e).__name__}: {e}") from e


def _is_outage(e: BaseException) -> bool:
    """The tier is down or failing, as opposed to refusing this request's media."""
    status = getattr(e, "status", None)
    return not isinstance(e, E.EncoderError) or status is None or status >= 500


def _client_error(e: BaseException) -> ProxyError:
    if isinstance(e, asyncio.TimeoutError):
        return ProxyError(504, "the encode tier did not answer within --encoder-timeout", "timeout")
    assert isinstance(e, E.EncoderError)
    status = getattr(e, "status", None)
    if status is not None and status < 500:
        if status in (401, 403):  # the proxy's key, not the client's: the operator must fix it
            return ProxyError(502, f"the encode tier refused the proxy's key ({status}): {e.message}", e.code)
        return ProxyError(status, e.message, e.code)
    if isinstance(e, E.RequestTimeout) and status is None:
        return ProxyError(504, e.message, e.code)
    return ProxyError(503, f"the encode tier is unavailable: {e.message}", e.code)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProxyError(413, f"request body over --max-body-mb ({limit >> 20} MiB)")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProxyError(413, f"request body over --max-body-mb ({limit >> 20} MiB)")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody reads the answer: 499 for the access log, as nginx and our server
        raise ProxyError(499, "the client disconnected before its body was in", "cancelled") from None
    return b"".join(chunks)


def create_proxy_app(config: ProxyConfig, encoder: Encoder, upstream: Upstream) -> FastAPI:
    """The app over injected collaborators (tests pass fakes; ``build`` the real ones)."""
    proxy = Proxy(config, encoder, upstream)
    app = FastAPI(title="epd-encoder proxy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc.status, exc.message, exc.code)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.chat(request)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def passthrough(request: Request) -> Response:
        return await proxy.forward(request, await read_body(request, config.max_body_mb << 20))

    return app


def build(config: ProxyConfig) -> FastAPI:
    """The app over the real encode client and vLLM connection pool, closed at shutdown."""
    from contextlib import asynccontextmanager

    from epd_encoder.client import AsyncEncodeClient

    encoder = AsyncEncodeClient(config.encoder or "", api_key=config.encoder_api_key,
                                timeout=config.encoder_timeout)
    # No cap below the server's own: streams hold a connection each for their whole answer.
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.llm_timeout, connect=10.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    app = create_proxy_app(config, encoder, Upstream(LLMPool(config.llm), client))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await client.aclose()
        await encoder.close()

    app.router.lifespan_context = lifespan
    return app


def run(config: ProxyConfig) -> int:
    import uvicorn

    logging.getLogger().setLevel(config.log_level.upper())
    # httpx logs each request at INFO: two lines per proxied request is the hot path's cost.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    from epd_encoder.server.http import drain_exits_zero

    with drain_exits_zero():
        uvicorn.run(build(config), host=config.host, port=config.port, log_level=config.log_level,
                    access_log=config.log_level == "debug")
    return 0
