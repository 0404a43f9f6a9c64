# SPDX-License-Identifier: Apache-2.0
"""The FastAPI app: routes only. Work lives in the Runtime; errors map in api/errors.py."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import Annotated, Callable

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.routing import Match

from epd_encoder import __version__
from epd_encoder.api import errors as api_errors
from epd_encoder.api import openapi
from epd_encoder.api.info import BuildInfoCollector, info
from epd_encoder.api.metrics import Metrics
from epd_encoder.api.middleware import BearerAuth, BodyLimit, Drain, RequestMetrics
from epd_encoder.api.parse import parse_encode_body, request_doc
from epd_encoder.api.schemas import InfoResponse, ItemInfo, ModelCard, ModelList, PullResponse, PushResponse
from epd_encoder.config import ServeConfig
from epd_encoder.errors import EncoderError, NotFound, NotReady, SchemaError, TooLarge, clip
from epd_encoder.transfer.ec.store import ECStore, ec_rows, open_store
from epd_encoder.wire import ItemMeta, pack_inline, pack_item

log = logging.getLogger(__name__)
OCTET = "application/octet-stream"
KEY_PATTERN = r"^[0-9a-f]{64}$"  # a content key as pull answers name it (blake3, hex)
# After serving fails, probes and new requests get the typed 503 (with the reason) this long
# before the port closes: a balancer or client learns why, not just "connection refused".
SERVING_FAILED_LINGER_S = 2.0


class AppState:
    """Holds the runtime once it is built; the app answers 503 until then."""

    def __init__(self, config: ServeConfig, make_runtime: Callable[[ServeConfig, Metrics], object]) -> None:
        self.config, self.make_runtime = config, make_runtime
        self.runtime = None
        self.failed: BaseException | None = None
        self.metrics = Metrics()
        # Called once a load fails: `serve` stops the server and exits 1 (server/http.py run), so
        # systemd or Kubernetes restarts or reports it instead of probing a 503 for ever.
        self.on_failure: Callable[[BaseException], None] | None = None

    def load(self) -> None:
        try:
            runtime = self.make_runtime(self.config, self.metrics)
            if hasattr(runtime, "on_failure"):  # a runtime that can fail while serving (--tp > 1)
                runtime.on_failure = self.serving_failed
            runtime.start()
            self.runtime = runtime
        except BaseException as e:
            self.failed = e
            # One line naming the cause; the stack only at debug (it is ours, not the operator's).
            text = str(e) if isinstance(e, EncoderError) else f"{type(e).__name__}: {e}"
            cause = " ".join(text.split())
            log.error("model failed to load: %s", cause, exc_info=log.isEnabledFor(logging.DEBUG))
            if self.on_failure is not None:
                self.on_failure(e)

    def serving_failed(self, error: BaseException) -> None:
        """The loaded runtime can no longer serve (a tensor-parallel rank died or hung); any
        thread, once. Requests answer 503 with ``error`` from now on, and ``on_failure`` stops
        the server, which exits 1 once the answers are out."""
        self.failed = error
        log.error("serving failed, the server stops in %g s: %s", SERVING_FAILED_LINGER_S,
                  " ".join(str(error).split()))
        if self.on_failure is not None:
            timer = threading.Timer(SERVING_FAILED_LINGER_S, self.on_failure, (error,))
            timer.daemon = True
            timer.start()

    def ready_runtime(self):
        rt = self.runtime
        failure = getattr(rt, "failure", None)
        if isinstance(failure, EncoderError):  # typed (rank_failed), a fresh instance per request
            raise type(failure)(str(failure))
        if rt is None or not rt.ready:
            reason = f"model failed to load: {self.failed}" if self.failed else "the model is loading"
            raise NotReady(reason if rt is None else "the server is draining")
        return rt


def create_app(config: ServeConfig, make_runtime: Callable[[ServeConfig, Metrics], object],
               *, load_in_background: bool = True) -> FastAPI:
    state = AppState(config, make_runtime)
    ec_store = open_store(config.ec_store)  # ec_store delivery's target; None when not configured

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if load_in_background:
            threading.Thread(target=state.load, name="epd-load", daemon=True).start()
        else:
            await asyncio.get_running_loop().run_in_executor(None, state.load)
        yield
        if state.runtime is not None:
            await asyncio.get_running_loop().run_in_executor(None, state.runtime.stop)
        if ec_store is not None:
            ec_store.close()

    # No slash redirects: their absolute Location would echo the client's Host header.
    # docs_url/redoc_url None: api/openapi.py serves both pages with local assets.
    app = FastAPI(title="epd-encoder", version=__version__, lifespan=lifespan, redirect_slashes=False,
                  description="The encode tier for EPD-disaggregated VLM serving.", docs_url=None, redoc_url=None)
    app.state.epd = state
    api_errors.install(app)
    open_paths = _open_paths(app, config)
    openapi.install(app, config, open_paths)
    state.metrics.registry.register(BuildInfoCollector(lambda: state.runtime))

    # api/parse.py decodes the body under its caps, not FastAPI: the pydantic schema is for the docs.
    # Responses (200 inline/pull, 202 push, the errors) are documented in api/openapi.py.
    @app.post("/v1/encode", openapi_extra=request_doc())
    async def encode(request: Request):
        body = await parse_encode_body(await request.body(), max_items=config.limits.max_items)
        rt = state.ready_runtime()
        if body.delivery.mode == "ec_store" and ec_store is None:
            raise SchemaError("delivery mode ec_store needs --ec-store-path or --ec-store-mooncake on this server")
        if body.delivery.mode == "push":
            rid, prepared = await rt.front.encode_push(body, rt.push, rt.wire_item)
            items = [ItemInfo(**_push_info(rt, p)) for p in prepared]
            return JSONResponse(PushResponse(request_id=rid, model=rt.model_id, room=body.delivery.room,
                                             items=items).model_dump(exclude_none=True),
                                status_code=202, headers={"X-Request-Id": rid})
        encoded = await rt.front.encode(body, _disconnected(request))
        t0 = time.perf_counter()
        try:
            items = [(ItemMeta.describe(r.output, key=r.key.hex(), grid_thw=p.grid_thw, cache=r.cache,
                                        video=p.meta, tier=p.tier or "device"), r)
                     for r, p in zip(encoded.result.items, encoded.prepared)]
            if body.delivery.mode == "pull":
                # Device-to-host copies wait on the GPU: never on the event loop.
                return await asyncio.get_running_loop().run_in_executor(
                    rt.front.pool, _store_for_pull, rt, encoded.request_id, items)
            if ec_store is not None and body.delivery.mode == "ec_store":
                return await asyncio.get_running_loop().run_in_executor(
                    rt.front.pool, _store_for_ec, rt, ec_store, config.ec_store.ec_store_dtype,
                    encoded.request_id, items)
            payload = await asyncio.get_running_loop().run_in_executor(
                rt.front.pool, lambda: pack_inline([(m, r.output) for m, r in items],
                                                   model=rt.model_id, request_id=encoded.request_id))
        finally:
            encoded.result.release()
        rt.metrics.bytes_out.inc(len(payload))
        rt.metrics.delivery_s.observe(time.perf_counter() - t0)
        return Response(payload, media_type=OCTET, headers={"X-Request-Id": encoded.request_id})

    @app.get("/v1/embeddings/{key}")
    async def embedding(key: Annotated[str, Path(pattern=KEY_PATTERN, description="64 hex digits, from a pull answer")]):
        rt = state.ready_runtime()
        entry = rt.pull_store.get(key)
        if entry is None:
            raise NotFound(f"embedding {clip(key)} is unknown or no longer retained")
        meta, output = entry
        payload = await asyncio.get_running_loop().run_in_executor(
            rt.front.pool, lambda: pack_item(meta, output, model=rt.model_id))
        rt.metrics.bytes_out.inc(len(payload))
        return Response(payload, media_type=OCTET)

    @app.get("/v1/rooms/{room}")
    async def room_status(room: str, receiver: str):
        # Names are the prefills' own: a room is found only with its receiver's endpoint.
        rt = state.ready_runtime()
        status = rt.push.status(room, receiver)
        if status is None:
            raise NotFound(f"room {clip(room)} is unknown for this receiver, or its record expired")
        return status

    @app.get("/health")
    async def health():
        state.ready_runtime()
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        rt = state.ready_runtime()
        return ModelList(data=[ModelCard(id=rt.model_id, family=rt.family, hidden_size=rt.hidden_size,
                                         num_deepstack=rt.num_deepstack, modalities=list(rt.front.media))])

    @app.get("/info", response_model=InfoResponse)
    async def server_info():
        # Not ready_runtime(): a draining server still says what it is.
        rt = state.runtime
        if rt is None:
            state.ready_runtime()  # raises the NotReady that says why
        return info(rt, config)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    if config.sglang_encoder:  # SGLang's prefill posts here (integrations/sglang_encoder.py)
        from epd_encoder.integrations.sglang_encoder import add_sglang_routes

        add_sglang_routes(app, state, timeout=config.request_timeout)

    # Outermost last: metrics see every answer; auth runs on the headers, before the body is read.
    app.state.drain = Drain()  # begun by the HTTP server (server/http.py) when shutdown starts
    app.add_middleware(BodyLimit, max_bytes=config.max_body_mb << 20, timeout=config.http.body_timeout,
                       drain=app.state.drain, takes_body=_body_routes(app))
    if config.auth.api_key:
        app.add_middleware(BearerAuth, key=config.auth.api_key, open_paths=open_paths)
    app.add_middleware(RequestMetrics, metrics=state.metrics)
    return app


def _open_paths(app: FastAPI, config: ServeConfig) -> frozenset[str]:
    """The paths that need no key under --api-key."""
    paths = {"/health"} if not config.auth.protect_health else set()
    if config.auth.public_docs:
        paths |= openapi.doc_paths(app)
    if not config.auth.protect_metrics:
        paths.add("/metrics")
    return frozenset(paths)


def _body_routes(app: FastAPI) -> Callable[[dict], bool]:
    """Whether a request is for a route that reads a body (POST /v1/encode): BodyLimit reads
    no other body (docs/operations.md, "Connection states and timers")."""
    routes = [r for r in app.routes if isinstance(r, APIRoute) and r.methods & {"POST", "PUT", "PATCH"}]
    return lambda scope: any(r.matches(scope)[0] is Match.FULL for r in routes)


async def _disconnected(request: Request) -> None:
    """Resolves when the client goes away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _push_info(rt, prepared) -> dict:
    w = rt.wire_item(prepared)
    return dict(key=w.key, num_tokens=w.num_tokens, grid_thw=list(w.grid_thw), hidden_size=w.hidden_size,
                dtype=w.dtype, num_deepstack=w.num_deepstack, modality=prepared.modality, video=prepared.meta,
                cache="hit" if prepared.source.staged is None else "pending",
                tier=(prepared.tier or "device") if prepared.source.staged is None else None)


def _store_for_ec(rt, store: ECStore, dtype: str, request_id: str, items) -> JSONResponse:
    # Answered only once every item is in the store: vLLM's consumer looks it up on arrival.
    for meta, r in items:
        store.put(meta.key, ec_rows(r.output, dtype))
    body = PullResponse(request_id=request_id, model=rt.model_id, items=[ItemInfo(**m.to_json()) for m, _ in items])
    return JSONResponse(body.model_dump(exclude_none=True), headers={"X-Request-Id": request_id})


def _store_for_pull(rt, request_id: str, items) -> JSONResponse:
    infos = []
    for meta, r in items:
        host = r.output.map(lambda t: t.to("cpu"))
        if not rt.pull_store.put(meta.key, (meta, host), r.output.nbytes):
            raise TooLarge(f"item {meta.key} ({r.output.nbytes} bytes) exceeds the pull store; "
                           "use inline or push delivery")
        infos.append(ItemInfo(**meta.to_json(), url=f"/v1/embeddings/{meta.key}"))
    body = PullResponse(request_id=request_id, model=rt.model_id, items=infos)
    return JSONResponse(body.model_dump(), headers={"X-Request-Id": request_id})
