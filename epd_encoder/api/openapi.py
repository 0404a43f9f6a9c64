# SPDX-License-Identifier: Apache-2.0
"""The OpenAPI document as the server really answers, and the offline /docs and /redoc.

FastAPI's generated document knows only the routes' success models: it does not know the
typed error body (api/errors.py), the statuses the middleware answers (auth, body limits,
drain), the 202 of push delivery, the octet-stream bodies, or the bearer scheme (auth is
ASGI middleware, not a FastAPI dependency). ``build`` completes it from the same tables
the server uses, so the document and the answers cannot drift apart silently:
tests/e2e/test_schemathesis.py checks the one against the other.

The docs pages load Swagger UI and ReDoc from the ``fastapi-offline`` wheel, served here
under ``/docs/assets/``: no page makes a request beyond this server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse
from pydantic.json_schema import models_json_schema

from epd_encoder import errors as E
from epd_encoder.api.errors import status_of
from epd_encoder.api.schemas import ErrorBody, PullResponse, PushResponse, RoomStatus
from epd_encoder.config import ServeConfig

DOCS_URL, REDOC_URL, OAUTH2_REDIRECT_URL = "/docs", "/redoc", "/docs/oauth2-redirect"
ASSETS_URL = "/docs/assets"
_ASSET_DIR = Path(fastapi_offline.__file__).parent / "static"
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "redoc.standalone.js": "text/javascript", "favicon.png": "image/png"}

OCTET = "application/octet-stream"
_REF = "#/components/schemas/{model}"
BEARER = "bearerAuth"

# The error statuses each operation can answer besides 401 (added where the key is needed).
# Middleware answers 408/413/503 to a body (BodyLimit), 503 to any request while draining;
# FastAPI answers 422 to a missing query parameter; 500 is anything unexpected.
ROUTE_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/encode"): (400, 408, 409, 413, 415, 422, 429, 499, 500, 503, 504),
    ("get", "/v1/embeddings/{key}"): (404, 422, 500, 503),
    ("get", "/v1/rooms/{room}"): (404, 422, 500, 503),
    ("get", "/health"): (500, 503),
    ("get", "/info"): (500, 503),
    ("get", "/v1/models"): (500, 503),
    ("get", "/metrics"): (500,),
}
_REASONS = {400: "Invalid input", 401: "Missing or wrong bearer token", 404: "Not found",
            408: "The body did not arrive in time", 409: "Conflict", 413: "Too large",
            415: "Unsupported media", 422: "Schema error", 429: "Overloaded; retry later",
            499: "Client closed the request (sent to nobody)", 500: "Internal error",
            503: "Not ready, draining, or at the connection cap; retry later", 504: "Timed out"}
# Answered by the framework or the HTTP server, not by a typed error.
_EXTRA_CODES = {404: ("not_found",), 422: ("schema_error",), 500: ("internal",), 503: ("overloaded",)}


def codes_by_status() -> dict[int, list[str]]:
    """Every stable error code under the status api/errors.py maps it to."""
    out: dict[int, set[str]] = {}
    todo: list[type[E.EncoderError]] = [E.EncoderError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if issubclass(cls, E.ConfigError):  # start-up only: never a request's answer
            continue
        out.setdefault(status_of(cls()), set()).add(cls.code)
    for status, codes in _EXTRA_CODES.items():
        out.setdefault(status, set()).update(codes)
    return {s: sorted(c) for s, c in out.items()}


def _error_response(status: int, codes: dict[int, list[str]]) -> dict:
    listed = ", ".join(f"`{c}`" for c in codes.get(status, ())) or "see docs/api.md"
    response: dict[str, Any] = {
        "description": f"{_REASONS.get(status, 'Error')}. Codes: {listed}.",
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorBody")}}}}
    if status in (429, 503):
        response["headers"] = {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "string"}}}
    if status == 401:
        response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return response


def _json(model: str) -> dict:
    return {"application/json": {"schema": {"$ref": _REF.format(model=model)}}}


# Success answers FastAPI cannot infer from the handlers (they return Response objects).
_SUCCESS: dict[tuple[str, str], dict[str, dict]] = {
    ("post", "/v1/encode"): {
        "200": {"description": "inline: a safetensors file (`item.{i}.embedding`, ...); pull: JSON with "
                               "one `url` per item; ec_store: the same JSON without urls, once every item is "
                               "in the vLLM connector's store",
                "content": {OCTET: {"schema": {"type": "string", "format": "binary"}}, **_json("PullResponse")}},
        "202": {"description": "push: accepted once preprocessed; the bytes follow to the receiver",
                "content": _json("PushResponse")},
    },
    ("get", "/v1/embeddings/{key}"): {
        "200": {"description": "one item as a safetensors file",
                "content": {OCTET: {"schema": {"type": "string", "format": "binary"}}}},
    },
    ("get", "/v1/rooms/{room}"): {"200": {"description": "the room's state", "content": _json("RoomStatus")}},
    ("get", "/health"): {
        "200": {"description": "loaded and warmed up",
                "content": {"application/json": {"schema": {
                    "type": "object", "required": ["status"],
                    "properties": {"status": {"type": "string", "enum": ["ok"]}}}}}},
    },
    ("get", "/metrics"): {
        "200": {"description": "Prometheus text exposition format 0.0.4",
                "content": {"text/plain": {"schema": {"type": "string"}}}},
    },
}


def build(app: FastAPI, config: ServeConfig, open_paths: Iterable[str]) -> dict:
    """The OpenAPI document of ``app`` as configured by ``config``."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    # The server never sends FastAPI's validation-error shape: every 422 is an ErrorBody.
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    _, defs = models_json_schema([(m, "serialization") for m in (ErrorBody, PullResponse, PushResponse, RoomStatus)],
                                 ref_template=_REF)
    schemas.update(defs["$defs"])
    keyed, open_paths = bool(config.auth.api_key), frozenset(open_paths)
    if keyed:
        doc["components"]["securitySchemes"] = {BEARER: {"type": "http", "scheme": "bearer",
                                                         "description": "--api-key"}}
        doc["security"] = [{BEARER: []}]
    codes = codes_by_status()
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            responses.update(_SUCCESS.get((method, path), {}))
            needs_key = keyed and path not in open_paths
            for status in ROUTE_ERRORS.get((method, path), (500,)) + ((401,) if needs_key else ()):
                responses[str(status)] = _error_response(status, codes)
            if keyed:
                op["security"] = [{BEARER: []}] if needs_key else []
    return doc


def install(app: FastAPI, config: ServeConfig, open_paths: Iterable[str]) -> None:
    """Replace ``app.openapi`` with ``build`` (cached) and add the offline docs pages."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, config, open_paths)
        return app.openapi_schema

    app.openapi = openapi
    _docs(app)


def doc_paths(app: FastAPI) -> frozenset[str]:
    """Every path the docs pages need, assets included: opened together by --public-docs."""
    return frozenset({DOCS_URL, REDOC_URL, OAUTH2_REDIRECT_URL, app.openapi_url,
                      *(f"{ASSETS_URL}/{name}" for name in ASSETS)})


# The pages may load from this server only: ReDoc's bundle hard-codes a logo on cdn.redoc.ly,
# which the browser then refuses (ReDoc hides the image). Inline script and style: both UIs use them.
DOCS_CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
            "frame-ancestors 'none'; base-uri 'none'; form-action 'self'")


def _page(response):
    response.headers["Content-Security-Policy"] = DOCS_CSP
    return response


def _docs(app: FastAPI) -> None:
    title, spec = app.title, app.openapi_url
    favicon = f"{ASSETS_URL}/favicon.png"

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui():
        # validatorUrl null: Swagger UI would otherwise send the document to validator.swagger.io.
        return _page(get_swagger_ui_html(
            openapi_url=spec, title=f"{title} - Swagger UI", oauth2_redirect_url=OAUTH2_REDIRECT_URL,
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=favicon, swagger_ui_parameters={"validatorUrl": None}))

    @app.get(OAUTH2_REDIRECT_URL, include_in_schema=False)
    async def swagger_ui_redirect():
        return _page(get_swagger_ui_oauth2_redirect_html())

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc():
        return _page(get_redoc_html(openapi_url=spec, title=f"{title} - ReDoc",
                                    redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
                                    redoc_favicon_url=favicon, with_google_fonts=False))

    for name, media_type in ASSETS.items():
        _asset(app, name, media_type)


def _asset(app: FastAPI, name: str, media_type: str) -> None:
    path = _ASSET_DIR / name

    # One exact route per file (no StaticFiles mount): --public-docs opens exact paths only.
    @app.get(f"{ASSETS_URL}/{name}", include_in_schema=False)
    async def asset():
        return FileResponse(path, media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})
