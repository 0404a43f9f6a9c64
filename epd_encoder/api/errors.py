# SPDX-License-Identifier: Apache-2.0
"""The one place where typed errors become HTTP statuses and bodies."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from epd_encoder import errors as E

log = logging.getLogger(__name__)

# Most specific first: the first class an error is an instance of decides.
STATUS: tuple[tuple[type[E.EncoderError], int], ...] = (
    (E.Unauthorized, 401),
    (E.NotFound, 404),
    (E.BodyTimeout, 408),
    (E.DuplicateRequest, 409),
    (E.TooLarge, 413),
    (E.UnsupportedMedia, 415),
    (E.SchemaError, 422),
    (E.InvalidInput, 400),
    (E.Overloaded, 429),
    (E.Cancelled, 499),
    (E.RankFailed, 503),  # and RankMismatch: the server is unhealthy, not the request
    (E.NotReady, 503),
    (E.RequestTimeout, 504),
    (E.EncoderError, 500),
)


def status_of(exc: E.EncoderError) -> int:
    return next(status for cls, status in STATUS if isinstance(exc, cls))


# Every message is cut here, whoever built it: even all escaped (6 bytes a character in
# JSON) a body stays under 4 KiB, so no client value is echoed back at length.
MAX_MESSAGE_CHARS = 512


def error_body(code: str, message: str) -> dict:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS - 1] + "…"
    return {"error": {"code": code, "message": message}}


def error_response(exc: E.EncoderError) -> JSONResponse:
    status = status_of(exc)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(exc.code, exc.message), status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    """Register the handlers; routes raise typed errors and never build error bodies."""

    @app.exception_handler(E.EncoderError)
    async def _typed(request: Request, exc: E.EncoderError) -> JSONResponse:
        if status_of(exc) >= 500:
            # A probe answered "not ready" is the probe working, not a fault: once per probe
            # period while a model loads would bury the log.
            probe = isinstance(exc, E.NotReady) and request.url.path in ("/health", "/info")
            log.log(logging.DEBUG if probe else logging.WARNING, "%s %s: %s", request.method,
                    request.url.path, exc)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _schema(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request"
        return JSONResponse(error_body(E.SchemaError.code, message), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal", "internal server error"), status_code=500)
