# SPDX-License-Identifier: Apache-2.0
"""SGLang 0.5.23's encoder protocol, served from our engine (``serve --sglang-encoder``).

SGLang's prefill (``--language-only --encoder-urls URL``) posts each part of a
request to ``POST /encode``: ``{req_id: "<rid>_local_part_<i>", modality:
"IMAGE"|"VIDEO", mm_items: [url | {url, ...}], num_parts, part_idx,
prefill_host, embedding_port}``. We encode the items through the same front as
``/v1/encode`` (keys, cache, coalescing, the tower) and push one two-frame ZMQ
message (sglang_wire.py) per destination:

- ``embedding_port`` an int (``zmq_to_tokenizer``) or a list (``zmq_to_scheduler``
  with ports): ``tcp://prefill_host:port`` each;
- ``embedding_port`` null (``zmq_to_scheduler``, SGLang's default): the
  ``receive_count`` URLs its scheduler ranks register at
  ``POST /scheduler_receive_url``, before or after the ``/encode``.

The rows are each item's embedding with its deepstack tensors concatenated on
the hidden axis (``[rows, hidden * (1 + num_deepstack)]``, items in order), in
the tower's dtype: the layout SGLang's own encoder sends. The ``mooncake``
backend (``/send``, ``/scheduler_receive_meta_data``) is not served: 501.
A failed encode is pushed as an error part too, so the prefill fails the
request at once instead of waiting for its receive timeout; then it raises
the typed error that api/errors.py maps.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from epd_encoder.api.errors import status_of
from epd_encoder.api.parse import refuse_duplicate_keys
from epd_encoder.api.schemas import EncodeBody
from epd_encoder.errors import EncoderError, RequestTimeout, SchemaError, UnsupportedMedia
from epd_encoder.integrations.sglang_wire import MODALITIES, embedding_data

MAX_PENDING_REGISTRATIONS = 65536  # receive URLs waiting for their /encode; the oldest go first
SEND_TIMEOUT_S = 30.0  # one ZMQ push (the prefill's PULL socket must take it); SGLang's default
_ITEM_KEYS = {"url", "content_hash", "detail"}  # an item dict's keys that leave its rows as they are


class Ready(Protocol):
    def ready_runtime(self) -> Any: ...


@dataclass
class _Destinations:
    count: int | None = None
    urls: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    born: float = field(default_factory=time.monotonic)


class ReceiveUrls:
    """``/scheduler_receive_url`` registrations by part ``req_id`` (event-loop only)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._by_id: dict[str, _Destinations] = {}

    def register(self, req_id: str, count: int, url: str) -> None:
        self._prune()
        d = self._by_id.setdefault(req_id, _Destinations())
        d.count = count
        if url not in d.urls:
            d.urls.append(url)
        d.changed.set()

    async def wait(self, req_id: str, timeout: float) -> list[str]:
        """Every registered URL once ``receive_count`` have come; ``RequestTimeout`` after ``timeout``."""
        self._prune()
        d = self._by_id.setdefault(req_id, _Destinations())
        deadline = time.monotonic() + timeout
        try:
            while d.count is None or len(d.urls) < d.count:
                d.changed.clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout(f"{len(d.urls)}/{d.count or '?'} SGLang receive URLs registered "
                                         f"for {req_id} within {timeout:g} s")
                try:
                    await asyncio.wait_for(d.changed.wait(), left)
                except asyncio.TimeoutError:
                    continue
            return list(d.urls)
        finally:
            self._by_id.pop(req_id, None)

    def _prune(self) -> None:
        now = time.monotonic()
        for rid in [r for r, d in self._by_id.items() if now - d.born > self.ttl]:
            del self._by_id[rid]
        while len(self._by_id) >= MAX_PENDING_REGISTRATIONS:
            del self._by_id[next(iter(self._by_id))]


def encode_body(request: dict) -> tuple[EncodeBody, str]:
    """Our ``EncodeBody`` for one SGLang part, and its modality; ``SchemaError`` (422) when malformed."""
    rid = request.get("req_id")
    if not isinstance(rid, str) or not rid:
        raise SchemaError("req_id: a non-empty string is required")
    modality = request.get("modality")
    if not isinstance(modality, str) or modality.upper() not in MODALITIES:
        raise SchemaError(f"modality: one of {sorted(MODALITIES)}")
    modality = modality.upper()
    if modality not in ("IMAGE", "VIDEO"):
        raise UnsupportedMedia(f"{modality} is not served by this encode tier")
    n, i = request.get("num_parts"), request.get("part_idx")
    if not (type(n) is int and n > 0 and type(i) is int and 0 <= i < n):
        raise SchemaError("num_parts must be a positive integer and part_idx in [0, num_parts)")
    items = request.get("mm_items")
    if not isinstance(items, list) or not items:
        raise SchemaError("mm_items: a non-empty list is required")
    kind = "image_url" if modality == "IMAGE" else "video_url"
    out = []
    for it in items:
        url = it.get("url") if isinstance(it, dict) else it
        unsupported = sorted(set(it) - _ITEM_KEYS) if isinstance(it, dict) else []
        if unsupported:  # per-item processor options would change the rows; we apply only our own
            raise SchemaError(f"mm_items: unsupported per-item options {unsupported}")
        if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
            raise UnsupportedMedia("mm_items: SGLang items must be data:, http: or https: URLs")
        out.append({"type": kind, kind: {"url": url}})
    return EncodeBody.model_validate({"items": out}), modality


def destinations(request: dict) -> list[str] | None:
    """``tcp://host:port`` per pushed port, or None: wait for ``/scheduler_receive_url``."""
    port = request.get("embedding_port")
    if port is None:
        return None
    host = request.get("prefill_host")
    ports = port if isinstance(port, list) else [port]
    if not isinstance(host, str) or not host or not all(type(p) is int and 0 < p < 65536 for p in ports):
        raise SchemaError("prefill_host and embedding_port (an int or a list of ints) are required together")
    return [f"tcp://{_bracket(host)}:{p}" for p in ports]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _tcp(url: str) -> str:
    return url if url.startswith("tcp://") else f"tcp://{url.split('://', 1)[-1]}"


class Pusher:
    """Sends two-frame messages to SGLang PULL sockets; one short-lived PUSH socket per send."""

    def __init__(self, send_timeout: float = SEND_TIMEOUT_S) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.send_timeout = send_timeout

    def send(self, endpoint: str, frames: list[bytes | memoryview]) -> None:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, int(self.send_timeout * 1000))
        try:
            sock.connect(endpoint)
            tracker = sock.send_multipart(frames, copy=False, track=True)
            if tracker is not None:
                tracker.wait(self.send_timeout)  # frame 1 is borrowed from the tensor: keep it until sent
        finally:
            sock.close(linger=int(self.send_timeout * 1000))


def part_payload(encoded: Any) -> tuple[list[list[int]], Any]:
    """``(grid_thw per item, rows [sum tokens, hidden * (1 + deepstack)] on the CPU, contiguous)``."""
    import torch

    rows = [r.output.joined() for r in encoded.result.items]
    grid = [[int(g) for g in p.grid_thw] for p in encoded.prepared]
    return grid, torch.cat(rows).to("cpu").contiguous()


def add_sglang_routes(router: APIRouter | FastAPI, state: Ready, *, timeout: float,
                      pusher: Pusher | None = None) -> None:
    """Add the protocol's routes to ``router`` (the app itself: FastAPI 0.165 includes an
    APIRouter lazily, out of the app's route list that BodyLimit reads). ``timeout``
    bounds the wait for receive URLs (the request timeout)."""
    urls = ReceiveUrls(ttl=timeout)
    push = pusher or Pusher()

    async def deliver(targets: list[str], frames: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(loop.run_in_executor(None, push.send, t, frames) for t in targets))
        except (zmq.ZMQError, zmq.NotDone) as e:  # SNDTIMEO / IMMEDIATE / the tracker: not taken in time
            raise RequestTimeout(f"the SGLang prefill at {', '.join(targets)} took no embedding "
                                 f"within {push.send_timeout:g} s: {e}") from e

    @router.post("/encode", tags=["sglang"])
    async def encode(request: Request) -> JSONResponse:
        raw = await _json_object(request)
        body, modality = encode_body(raw)
        targets = destinations(raw)
        rid, n, i = raw["req_id"], raw["num_parts"], raw["part_idx"]
        rt = state.ready_runtime()
        try:
            encoded = await rt.front.encode(body)
            try:
                grid, rows = await asyncio.get_running_loop().run_in_executor(rt.front.pool, part_payload, encoded)
            finally:
                encoded.result.release()
        except EncoderError as e:
            err = embedding_data(req_id=rid, num_parts=n, part_idx=i, modality=modality, grid_thw=None,
                                 shape=None, dtype=None, error_msg=e.message, error_code=status_of(e))
            try:
                await deliver(targets if targets is not None else await urls.wait(rid, timeout), [err])
            except EncoderError:
                pass  # the prefill times out on its own; the HTTP answer still names the cause
            raise
        extra = _video_extra(encoded.prepared) if modality == "VIDEO" else None
        meta = embedding_data(req_id=rid, num_parts=n, part_idx=i, modality=modality, grid_thw=grid,
                              shape=list(rows.shape), dtype=str(rows.dtype).removeprefix("torch."), extra=extra)
        view = _bytes_view(rows)
        await deliver(targets if targets is not None else await urls.wait(rid, timeout), [meta, view])
        return JSONResponse(None)

    @router.post("/scheduler_receive_url", tags=["sglang"])
    async def receive_url(request: Request) -> JSONResponse:
        raw = await _json_object(request)
        rid, count, url = (raw.get(k) for k in ("req_id", "receive_count", "receive_url"))
        if not isinstance(rid, str) or not isinstance(url, str) or type(count) is not int or count < 1:
            raise SchemaError("req_id, receive_count (>= 1) and receive_url are required")
        urls.register(rid, count, _tcp(url))
        return JSONResponse(None)

    @router.post("/send", tags=["sglang"])
    @router.post("/scheduler_receive_meta_data", tags=["sglang"])
    async def mooncake_only() -> JSONResponse:
        return JSONResponse({"status": "error", "message": "the mooncake encoder transfer backend is not "
                             "served; run SGLang with --encoder-transfer-backend zmq_to_scheduler"},
                            status_code=501)


async def _json_object(request: Request) -> dict:
    try:
        raw = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise SchemaError("the body is not valid JSON") from None
    if not isinstance(raw, dict):
        raise SchemaError("the body must be a JSON object")
    refuse_duplicate_keys(await request.body())  # as /v1/encode: last-wins could name another host
    return raw


def _bytes_view(rows: Any) -> memoryview:
    """The rows' bytes, row-major, without a copy (frame 1: ``torch.frombuffer(frame, dtype)``)."""
    import torch

    return memoryview(rows.reshape(-1).view(torch.uint8).numpy())


def _video_extra(prepared: list[Any]) -> dict[str, Any]:
    """Per-video timing as SGLang's Qwen-VL processors read it: one entry per video."""
    metas = [p.meta or {} for p in prepared]
    extra: dict[str, Any] = {}
    if all(m.get("second_per_grid_ts") is not None for m in metas):
        extra["second_per_grid_ts"] = [float(m["second_per_grid_ts"]) for m in metas]
    if all(m.get("timestamps") is not None for m in metas):
        extra["video_timestamps"] = [[float(t) for t in m["timestamps"]] for m in metas]
    return extra
