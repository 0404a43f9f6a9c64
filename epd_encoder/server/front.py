# SPDX-License-Identifier: Apache-2.0
"""The async front: body → bytes → keys → (pre)processing → engine → result.

It never blocks the event loop on the model: bytes are decoded and
preprocessed in a thread pool, the engine runs on its own thread, and the
wait for a result races the request's deadline and the client's disconnect.
Every request for a key that is being staged, queued or encoded shares one
staged copy (server/staging.py), and a key already cached is not
preprocessed at all. A request that fails, times
out or is cancelled stops all of its items at once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

import pydantic

from epd_encoder.api.metrics import Metrics
from epd_encoder.api.schemas import EncodeBody
from epd_encoder.cache.shared import SharedTier
from epd_encoder.config import LimitsConfig
from epd_encoder.engine.loop import EngineLoop, FutureSink, RequestResult
from epd_encoder.engine.worker import EncodeRequest, WorkItem
from epd_encoder.errors import (
    Cancelled,
    EncoderError,
    ImageTooLarge,
    InvalidBase64,
    Overloaded,
    RequestTimeout,
    SchemaError,
    TooManyItems,
    UnsupportedMedia,
)
from epd_encoder.preprocess.base import DecodeLimits, ImagePreprocessor
from epd_encoder.preprocess.keys import KeyContext
from epd_encoder.server.budget import ByteBudget
from epd_encoder.server.executor import PartSource, PixelSource
from epd_encoder.server.media import ImageMedia, Media
from epd_encoder.server.memory import DrainTrimmer
from epd_encoder.server.request_work import ItemWork, Pins, all_or_none
from epd_encoder.server.staging import StagingTable


class Fetcher(Protocol):
    async def fetch(self, url: str) -> bytes: ...


Fetchers = Fetcher | dict[str, Fetcher]  # one for all, or one per modality (its own byte limit)


@dataclass(frozen=True)
class Prepared:
    key: bytes
    grid_thw: tuple[int, int, int]
    num_tokens: int
    cost: int
    source: PixelSource
    pinned: bool = False  # a cache hit the front holds until the request ends
    modality: str = "image"
    meta: dict | None = None  # video timing (api/schemas.py VideoInfo)
    tier: str | None = None  # where the front found a hit: device, host or shared
    ready: Any = None  # a shared-tier hit's output (on the device): the engine delivers it as is


@dataclass
class Encoded:
    request_id: str
    result: RequestResult
    prepared: list[Prepared]

    @property
    def grids(self) -> list[tuple[int, int, int]]:
        return [p.grid_thw for p in self.prepared]


class _PushSink:
    """Hands a finished request to its push room (on the engine thread, never blocking)."""

    def __init__(self, room: Any, metrics: Metrics, pins: "Pins",
                 encoded: Callable[[list], None] | None = None) -> None:
        self.room, self.metrics, self.pins, self.items = room, metrics, pins, []
        self.encoded = encoded  # the shared tier's write-behind (never blocks)
        self.finished = False
        self.timer: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None

    def on_item(self, result) -> None:
        self.items.append(result)

    def on_finish(self, outcome) -> None:
        self.finished = True
        items, self.items = sorted(self.items, key=lambda r: r.item_index), []
        self.pins.release()
        if self.timer is not None:
            loop, handle = self.timer
            loop.call_soon_threadsafe(handle.cancel)
        if outcome.state != "done":
            for item in items:
                item.release()
            self.room.fail(outcome.error or Cancelled("the request was cancelled"))
            return
        for item in items:
            self.metrics.items.labels(item.cache).inc()
        if self.encoded is not None:
            self.encoded(items)
        # The room owns the outputs now; nothing here keeps them alive.
        self.room.deliver([r.output for r in items], lambda: [r.release() for r in items])


def _b64(value: str, max_bytes: int, too_large: type[EncoderError] = ImageTooLarge) -> bytes:
    if value.startswith("data:"):
        head, sep, value = value.partition(",")
        if not sep or ";base64" not in head:
            raise InvalidBase64("a data URL must be base64: data:<mime>;base64,<data>")
    if len(value) > (max_bytes + 2) // 3 * 4 + 4:
        raise too_large(f"the item is over the {max_bytes}-byte limit")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidBase64(f"invalid base64: {e}") from e


class EncodeFront:
    def __init__(self, *, engine: EngineLoop, cache: Any, preprocessor: ImagePreprocessor,
                 model_id: str, revision: str, limits: LimitsConfig, metrics: Metrics,
                 request_timeout: float, workers: int, fetcher: Fetchers | None = None,
                 attention_weight: float = 0.0, max_preprocess_items: int = 512,
                 trim: Callable[[], Any] | None = None, video: Media | None = None,
                 max_batch_cost: int | None = None, shared: SharedTier | None = None) -> None:
        # ``trim`` (memory.trim) runs on the pool when decoding drains: see memory.DrainTrimmer.
        # ``model_id`` and ``revision`` are only the content keys' model fields: the runtime
        # passes a path-independent identity, not the display name (docs/models.md).
        self.engine, self.cache, self.pre = engine, cache, preprocessor
        self.model_id, self.revision, self.limits = model_id, revision, limits
        self.metrics, self.timeout, self.fetcher = metrics, request_timeout, fetcher
        self.decode_limits = DecodeLimits(max_bytes=limits.max_image_bytes,
                                          max_pixels=limits.max_image_pixels,
                                          max_aspect_ratio=limits.max_aspect_ratio)
        self.media: dict[str, Media] = {"image": ImageMedia(preprocessor, self.decode_limits, metrics)}
        if video is not None:
            self.media["video"] = video
        self.max_batch_cost = max_batch_cost
        self.shared = shared  # the fleet's L3 (cache/shared.py), or None
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="epd-preprocess")
        self._contexts: dict[tuple, KeyContext] = {}
        self._attention_weight = attention_weight
        self.max_preprocess_items = max_preprocess_items
        self._preprocessing = 0  # items whose preprocessing still runs (event-loop only)
        trimmer = DrainTrimmer(trim, self.pool, idle=lambda: self.decoded.decoding == 0) if trim else None
        self.decoded = ByteBudget(limits.max_decoded_mb << 20, trimmer.drained if trimmer else None)
        self._staging = StagingTable(self.pool, self.decoded)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- the request path --------------------------------------------------------
    async def encode(self, body: EncodeBody, disconnected: Awaitable[Any] | None = None) -> Encoded:
        """Encode one request; raises its typed error. ``disconnected`` resolves
        when the client goes away, which cancels the request's queued work."""
        deadline = time.monotonic() + self.timeout
        rid = body.request_id or uuid.uuid4().hex
        gone = asyncio.ensure_future(disconnected) if disconnected is not None else None
        pins, sink = Pins(self.cache), None
        try:
            prepared = await self._prepare_all(rid, body, deadline, pins)
            if gone is not None and gone.done():
                raise Cancelled("the client disconnected")
            accepted = FutureSink()
            self._submit(rid, prepared, accepted)
            sink = accepted
            result = await self._wait(rid, sink, deadline, gone)
            if self.shared is not None:
                self._write_shared(result.items, prepared)
        finally:
            if sink is not None and not sink.future.done():
                # Timed out or gone: the engine still holds the request (its pixels, its
                # hits) until it ends it, exactly once; the pins and held keys go then.
                sink.future.add_done_callback(lambda _f: pins.release())
            else:
                pins.release()
            if gone is not None:
                gone.cancel()
        return Encoded(rid, result, prepared)

    async def encode_push(self, body: EncodeBody, sender: Any, wire_item: Any) -> tuple[str, list[Prepared]]:
        """Push mode: answer with the items' metadata once preprocessing is done; the
        bytes go to the receiver after the forward, on the sender's peer threads.

        ``wire_item(prepared) -> WireItem`` sizes an item before its forward runs.
        """
        deadline = time.monotonic() + self.timeout
        rid = body.request_id or uuid.uuid4().hex
        sender.precheck(body.delivery.model_dump())  # 429 for want of a peer slot, before any decoding
        pins = Pins(self.cache)
        try:
            prepared = await self._prepare_all(rid, body, deadline, pins)
            # The first room of a backend builds its plane (imports, engine start): off the loop.
            room = await asyncio.get_running_loop().run_in_executor(
                self.pool, sender.open, body.delivery.model_dump(), rid, [wire_item(p) for p in prepared])
        except BaseException:
            pins.release()
            raise
        sink = _PushSink(room, self.metrics, pins,
                         None if self.shared is None else lambda items: self._write_shared(items, prepared))
        try:
            self._submit(rid, prepared, sink)
        except EncoderError as e:
            pins.release()
            room.fail(e)
            raise

        # Past the deadline the request ends as a timeout. The sink check keeps a late
        # timer from failing a newer request that reuses this id.
        def expire() -> None:
            if not sink.finished:
                self.engine.fail(rid, RequestTimeout(f"no result within {self.timeout:g} s"))

        loop = asyncio.get_running_loop()
        sink.timer = (loop, loop.call_later(max(0.0, deadline - time.monotonic()), expire))
        return rid, prepared

    def _submit(self, rid: str, prepared: list[Prepared], sink: Any) -> None:
        items = tuple(WorkItem(p.key, p.cost, p.source, parts=self._parts(p), ready=p.ready) for p in prepared)
        # Hits the front pinned or read from L3 cost the queue nothing; the loop charges each
        # other key once across all outstanding requests (duplicates coalesce onto one encode).
        charge = {p.key: p.cost for p in prepared if not p.pinned and p.ready is None}
        self.engine.submit(EncodeRequest(rid, items), sink, charge=charge)

    async def _prepare_all(self, rid: str, body: EncodeBody, deadline: float, pins: Pins) -> list[Prepared]:
        try:
            sources = body.sources()
        except pydantic.ValidationError as e:
            raise SchemaError(f"messages: {e.errors()[0].get('msg', 'invalid content part')}") from e
        if not sources:
            raise SchemaError("the request has no image items")
        if len(sources) > self.limits.max_items:
            raise TooManyItems(f"{len(sources)} items; at most {self.limits.max_items} per request")
        resolved = {}
        for modality in dict.fromkeys(m for m, _, _ in sources):
            media = self.media.get(modality)
            if media is None:
                raise UnsupportedMedia(f"this model does not take {modality} input")
            params, options = media.resolve(body)
            resolved[modality] = (media, self._context(params, modality), options)
        self.engine.precheck(rid)  # 409 / 503 before any work; 429 per key, before decoding
        if self._preprocessing + len(sources) > self.max_preprocess_items:
            raise Overloaded(f"{self._preprocessing} items are already being preprocessed")
        loop, tasks = asyncio.get_running_loop(), []
        for modality, kind, value in sources:
            work = ItemWork(loop, self._work_ended)
            self._preprocessing += 1
            tasks.append(asyncio.ensure_future(self._prepare(*resolved[modality], kind, value, pins, work)))
            tasks[-1].add_done_callback(work.end)
        try:
            return await all_or_none(tasks, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError as e:
            raise RequestTimeout(f"preprocessing took over {self.timeout:g} s") from e

    def _work_ended(self) -> None:
        self._preprocessing -= 1

    async def _wait(self, rid: str, sink: FutureSink, deadline: float,
                    gone: asyncio.Future | None) -> RequestResult:
        done = asyncio.wrap_future(sink.future)
        waiters = {done} if gone is None else {done, gone}
        await asyncio.wait(waiters, timeout=max(0.0, deadline - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)
        # The engine-side future, not its asyncio wrapper (which lags it): a request
        # that already ended must not be failed or cancelled under a reused id.
        if not sink.future.done():
            if gone is not None and gone.done():
                self.engine.cancel(rid)
                error: EncoderError = Cancelled("the client disconnected")
            else:
                error = RequestTimeout(f"no result within {self.timeout:g} s")
                self.engine.fail(rid, error)
            # The engine still finishes the request exactly once; drop its pins then.
            done.add_done_callback(lambda f: f.cancelled() or f.result().release())
            raise error
        result: RequestResult = sink.future.result()
        if result.outcome.state != "done":
            raise result.outcome.error or Cancelled("the request was cancelled")
        for item in result.items:
            self.metrics.items.labels(item.cache).inc()
        return result

    def _write_shared(self, items: list, prepared: list[Prepared]) -> None:
        """Offer this server's fresh encodes to L3 (any thread; never blocks)."""
        assert self.shared is not None
        for item, p in zip(items, prepared):
            if item.cache == "miss":
                self.shared.offer(p.key, item.output, grid_thw=p.grid_thw, modality=p.modality, video=p.meta)

    def _tier(self, key: bytes) -> str:
        """The local tier of a key the front just pinned (a single-tier cache is L1)."""
        tier_of = getattr(self.cache, "tier_of", None)
        return "host" if tier_of is not None and tier_of(key) == 2 else "device"

    # -- per item ----------------------------------------------------------------
    def _context(self, params: dict, modality: str = "image") -> KeyContext:
        tag = (modality, *sorted((k, repr(v)) for k, v in params.items()))
        ctx = self._contexts.get(tag)
        if ctx is None:
            if len(self._contexts) > 64:
                self._contexts.clear()
            ctx = self._contexts[tag] = KeyContext(
                model_id=self.model_id, revision=self.revision, params=params, modality=modality)
        return ctx

    async def _offload(self, work: ItemWork, fn: Callable[..., Any], *args: Any) -> Any:
        job = self.pool.submit(fn, *args)
        try:
            return await asyncio.wrap_future(job)
        finally:
            work.abandon(job)  # a no-op once the job has ended

    async def _bytes(self, media: Media, kind: str, value: str, work: ItemWork) -> bytes:
        if kind == "url" and not value.startswith("data:"):
            if not value.startswith(("http://", "https://")):
                raise UnsupportedMedia(f"{media.modality} URLs must be data:, http: or https:")
            if self.fetcher is None:
                raise UnsupportedMedia(f"http(s) {media.modality} URLs are disabled on this server")
            fetcher = self.fetcher.get(media.modality) if isinstance(self.fetcher, dict) else self.fetcher
            return await fetcher.fetch(value)
        if len(value) < 1 << 16:
            return _b64(value, media.max_bytes, media.too_large)
        return await self._offload(work, _b64, value, media.max_bytes, media.too_large)

    async def _prepare(self, media: Media, ctx: KeyContext, options: Any, kind: str, value: str,
                       pins: Pins, work: ItemWork) -> Prepared:
        data = await self._bytes(media, kind, value, work)
        if len(data) > media.max_bytes:
            raise media.too_large(f"{len(data)} bytes; the limit is {media.max_bytes}")
        key, seen = await self._offload(work, lambda: (ctx.key(data), media.inspect(data, options)))
        cost = self._cost(seen.grid_thw)
        source = PixelSource(None, seen.stage, cost, media.finish, key=key)
        pinned = pins.take(key)  # a hit needs no pixels; ``stage`` stays as a fallback
        tier, ready = (self._tier(key) if pinned else None), None
        if not pinned and self.shared is not None and key not in self._staging:
            # Before any decoding: an L3 hit skips decode, preprocessing and the tower.
            ready = await self.shared.lookup(key, grid_thw=seen.grid_thw, num_tokens=seen.num_tokens)
            tier = "shared" if ready is not None else None
        if not pinned and ready is None:
            if key not in self._staging:  # a duplicate of staged, queued or running work is free
                self.engine.precheck(None, {key: cost})  # else 429 if the queue is full
            record = self._staging.join(key, lambda: source, seen.nbytes)
            pins.keep(functools.partial(self._staging.let_go, asyncio.get_running_loop(), record))
            source = await self._staging.wait(record, work)  # the key's one copy, not this one
        return Prepared(key, seen.grid_thw, seen.num_tokens, cost, source, pinned, media.modality, seen.meta,
                        tier, ready)

    def _parts(self, p: Prepared) -> tuple[tuple[PartSource, int], ...]:
        """A video over the batch budget, as chunks of whole temporal groups that fit it
        (each group is an independent attention sequence, so the output is the same)."""
        t, h, w = p.grid_thw
        if p.modality != "video" or self.max_batch_cost is None or p.cost <= self.max_batch_cost or t < 2:
            return ()
        per = max(1, self.max_batch_cost // self._cost((1, h, w)))
        spans = [(a, min(a + per, t)) for a in range(0, t, per)]
        costs = [self._cost((b - a, h, w)) for a, b in spans]
        return tuple((PartSource(p.source, a, b, c), c) for (a, b), c in zip(spans, costs))

    def _cost(self, grid: tuple[int, int, int]) -> int:
        from epd_encoder.engine.cost import item_cost

        return item_cost(grid, attention_weight=self._attention_weight)
