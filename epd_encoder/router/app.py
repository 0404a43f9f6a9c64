# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder route``'s HTTP front: a server's API, each item sent through Envoy on its own
routing key (docs/router.md). Stateless: everything it knows is in the request and in Envoy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.requests import ClientDisconnect

from epd_encoder import errors as E
from epd_encoder.api.errors import error_response, status_of
from epd_encoder.api.errors import install as install_error_handlers
from epd_encoder.config.router import RouterConfig
from epd_encoder.router.envoy_config import CLUSTER, PUSH_HEADER, ROUTING_HEADERS, SESSION_HEADER
from epd_encoder.router.split import Malformed, Plan, merge_inline, merge_json, plan

log = logging.getLogger(__name__)

KEY_HEADER = ROUTING_HEADERS[0]
_SPLIT_MODES = ("inline", "pull", "ec_store")
_PASS_HEADERS = ("content-type", "retry-after", "www-authenticate", SESSION_HEADER)
_OFF_LOOP = 64 << 10


class EnvoyAdmin(Protocol):
    """What the front needs of the Envoy process (``router.envoy.Envoy``)."""

    listener_url: str
    admin_url: str

    def alive(self) -> bool: ...


class Answer:
    """One upstream answer, read whole."""

    def __init__(self, r: httpx.Response) -> None:
        self.status, self.body = r.status_code, r.content
        self.headers = {k: r.headers[k] for k in _PASS_HEADERS if k in r.headers}

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def response(self) -> Response:
        if not self.ok and not self.headers.get("content-type", "").startswith("application/json"):
            return error_response(_local_reply(self))  # Envoy's own text answer, in our shape
        return Response(self.body, status_code=self.status, headers=self.headers)


def _local_reply(a: Answer) -> E.EncoderError:
    text = a.body[:200].decode(errors="replace")
    if a.status == 503:
        return E.NotReady(f"no encode server could take the item: {text}")
    if a.status == 504:
        return E.RequestTimeout(f"no encode server answered in time: {text}")
    if a.status == 413:
        return E.TooLarge(f"request body over the router's --max-body-mb: {text}")
    return E.EncodeFailed(f"the router's proxy answered {a.status}: {text}")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("epd_router_requests", "Encode requests answered, by status.",
                                ["status"], registry=self.registry)
        self.subrequests = Counter("epd_router_subrequests", "Per-item sub-requests, by status.",
                                   ["status"], registry=self.registry)
        self.seconds = Histogram("epd_router_request_seconds", "Encode request latency at the router.",
                                 registry=self.registry)


class Splitter:
    """Each encode request's path through Envoy; ``client`` speaks to Envoy's listener."""

    def __init__(self, config: RouterConfig, envoy: EnvoyAdmin, client: httpx.AsyncClient) -> None:
        self.config, self.envoy, self.client = config, envoy, client
        self.metrics = Metrics()

    async def send(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                   params: dict[str, str] | None = None) -> Answer:
        try:
            r = await self.client.request(method, self.envoy.listener_url + path, content=body,
                                          headers=headers, params=params)
        except httpx.TimeoutException as e:
            raise E.RequestTimeout(f"no answer through the router within {self.config.request_timeout:g} s") from e
        except httpx.TransportError as e:
            raise E.NotReady(f"the router's proxy is unreachable: {type(e).__name__}") from e
        return Answer(r)

    async def encode(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            response = await self._encode(request)
        except E.EncoderError as e:  # answered by the typed handler: counted here all the same
            self.metrics.requests.labels(str(status_of(e))).inc()
            self.metrics.seconds.observe(time.monotonic() - started)
            raise
        self.metrics.requests.labels(str(response.status_code)).inc()
        self.metrics.seconds.observe(time.monotonic() - started)
        return response

    async def _encode(self, request: Request) -> Response:
        raw = await read_body(request, self.config.max_body_mb << 20)
        auth = {"authorization": request.headers["authorization"]} if "authorization" in request.headers else {}
        if len(raw) > _OFF_LOOP:  # base64 decoding and hashing of big bodies off the event loop
            split = await asyncio.to_thread(plan, raw, max_items=self.config.max_items)
        else:
            split = plan(raw, max_items=self.config.max_items)
        if split is None or split.mode not in _SPLIT_MODES:
            headers = {"content-type": "application/json", **auth}
            if split is not None:  # push: one server delivers the whole request into the room
                headers |= {KEY_HEADER: split.keys[0], PUSH_HEADER: split.mode}
            answer = await self.send("POST", "/v1/encode", raw, headers)
            response = answer.response()
        else:
            response = await self._split(split, auth)
        return response

    async def _split(self, split: Plan, auth: dict[str, str]) -> Response:
        async def one(i: int) -> Answer:
            headers = {"content-type": "application/json", KEY_HEADER: split.keys[i], **auth}
            answer = await self.send("POST", "/v1/encode", split.sub_body(i), headers)
            self.metrics.subrequests.labels(str(answer.status)).inc()
            return answer

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(split.items))]
        try:
            answers = await asyncio.gather(*tasks)
        except BaseException:  # the client left, or Envoy is gone: drop the other items' requests
            for task in tasks:
                task.cancel()
            raise
        failed = next((a for a in answers if not a.ok), None)
        if failed is not None:  # the first failing item in order decides, as on one server
            return failed.response()
        bodies, rid = [a.body for a in answers], split.request_id
        big = sum(len(b) for b in bodies) > _OFF_LOOP  # joins of many MiB off the event loop
        try:
            if split.mode == "inline":
                body = await asyncio.to_thread(merge_inline, bodies, rid) if big else merge_inline(bodies, rid)
                return Response(body, media_type="application/octet-stream")
            sessions = [a.headers.get(SESSION_HEADER) if split.mode == "pull" else None for a in answers]
            return Response(merge_json(bodies, sessions, rid), media_type="application/json")
        except Malformed as e:
            raise E.EncodeFailed(f"a server's answer could not be reassembled: {e}") from e

    async def forward(self, request: Request, path: str, session: str | None = None) -> Response:
        """A GET answered by one server: any, or the one ``session`` names (a pull's holder)."""
        headers = {k: request.headers[k] for k in ("authorization", "accept") if k in request.headers}
        if session:
            headers[SESSION_HEADER] = session
        params = {k: v for k, v in request.query_params.items() if k != "upstream"}
        return (await self.send("GET", path, None, headers, params)).response()

    async def healthy_servers(self) -> int:
        r = await self.client.get(self.envoy.admin_url + "/stats", params={
            "format": "json", "filter": rf"^cluster\.{CLUSTER}\.membership_healthy$"})
        stats = r.json().get("stats", [])
        return int(stats[0]["value"]) if stats else 0

    async def metrics_text(self) -> bytes:
        own = generate_latest(self.metrics.registry)
        try:
            r = await self.client.get(self.envoy.admin_url + "/stats/prometheus")
            return own + r.content
        except httpx.HTTPError as e:
            log.warning("envoy's stats are unavailable: %s", e)
            return own


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise E.TooLarge(f"request body over --max-body-mb ({limit >> 20} MiB)")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise E.TooLarge(f"request body over --max-body-mb ({limit >> 20} MiB)")
            chunks.append(chunk)
    except ClientDisconnect:  # a 499 to nobody, as on a server; not a 500 and a traceback
        raise E.Cancelled("the client went away before its body arrived") from None
    return b"".join(chunks)


def create_router_app(config: RouterConfig, envoy: EnvoyAdmin, client: httpx.AsyncClient) -> FastAPI:
    """The router's routes over an Envoy (started by ``run``, or a test's)."""
    splitter = Splitter(config, envoy, client)
    app = FastAPI(title="epd-encoder route", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.splitter = splitter
    install_error_handlers(app)  # a server's own: typed errors, unknown paths and methods alike

    @app.post("/v1/encode")
    async def encode(request: Request) -> Response:
        return await splitter.encode(request)

    @app.get("/v1/embeddings/{key}")
    async def embedding(key: str, request: Request) -> Response:
        return await splitter.forward(request, f"/v1/embeddings/{key}", request.query_params.get("upstream"))

    @app.get("/v1/rooms/{room}")
    async def room(room: str, request: Request) -> Response:
        return await splitter.forward(request, f"/v1/rooms/{room}", request.query_params.get("upstream"))

    @app.get("/info")
    async def info(request: Request) -> Response:
        return await splitter.forward(request, "/info")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await splitter.forward(request, "/v1/models")

    @app.get("/health")
    async def health() -> JSONResponse:
        if not envoy.alive():
            raise E.NotReady("the router's Envoy is not running")
        try:
            healthy = await splitter.healthy_servers()
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise E.NotReady(f"the router's Envoy admin is unreachable: {type(e).__name__}") from e
        if healthy < 1:
            raise E.NotReady("no encode server is healthy")
        return JSONResponse({"status": "ok", "healthy_servers": healthy})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await splitter.metrics_text(), media_type="text/plain; version=0.0.4")

    return app


def run(config: RouterConfig) -> int:
    """Start Envoy, serve the front until stopped, stop Envoy. 1 if Envoy exits under us."""
    from pathlib import Path

    import uvicorn

    from epd_encoder.router.envoy import Envoy, EnvoyFailed
    from epd_encoder.router.membership import Backend

    logging.getLogger().setLevel(config.log_level.upper())
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    backends = [Backend.from_url(u) for u in config.backend]
    eds = Path(config.backends_file) if config.backends_file else None
    try:
        envoy = Envoy(config, backends, eds).start()
    except EnvoyFailed as e:
        log.error("%s", e)
        return 1
    client = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(config.request_timeout + 5, connect=5.0),
                               limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
    server = uvicorn.Server(uvicorn.Config(create_router_app(config, envoy, client), host=config.host,
                                           port=config.port, log_level=config.log_level,
                                           access_log=config.log_level == "debug"))
    lost: list[bool] = []

    async def watch() -> None:  # Envoy gone: exit, so the supervisor restarts the pair
        while not server.should_exit:
            if not envoy.alive():
                log.error("envoy exited (status %s); the router stops", envoy.proc and envoy.proc.returncode)
                lost.append(True)
                server.should_exit = True
            await asyncio.sleep(0.5)

    async def serve() -> None:
        watcher = asyncio.create_task(watch())
        try:
            await server.serve()
        finally:
            watcher.cancel()
            await client.aclose()

    from epd_encoder.server.http import drain_exits_zero

    try:
        with drain_exits_zero():
            asyncio.run(serve())
    finally:
        envoy.stop()
    return 1 if lost else 0
