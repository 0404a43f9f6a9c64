# SPDX-License-Identifier: Apache-2.0
"""Unit tests of the front's pieces (the request path itself is tested end to end)."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from PIL import Image

from epd_encoder.api.metrics import Metrics
from epd_encoder.api.schemas import EncodeBody
from epd_encoder.config import LimitsConfig
from epd_encoder.cache.lru import EmbeddingCache
from epd_encoder.engine.worker import ItemResult, Outcome
from epd_encoder.preprocess.base import StagedImage
from epd_encoder.errors import Cancelled, ImageTooLarge, InvalidBase64, RequestTimeout, UndecodableImage
from epd_encoder.server.front import EncodeFront, _b64, _PushSink
from epd_encoder.server.request_work import Pins
from epd_encoder.types import ItemOutput


class Room:
    def __init__(self):
        self.delivered, self.failed, self.release = None, None, None

    def deliver(self, outputs, release):
        self.delivered, self.release = outputs, release

    def fail(self, error):
        self.failed = error


def result(i, tensor, released):
    return ItemResult("r", i, bytes([i]) * 32, ItemOutput(tensor), "miss", lambda: released.append(i))


def test_push_sink_hands_outputs_over_and_keeps_none():
    room, released = Room(), []
    cache = EmbeddingCache(capacity_bytes=1 << 20)
    cache.put(b"k" * 32, "v", 1)
    pins = Pins(cache)
    assert pins.take(b"k" * 32) and not pins.take(b"x" * 32)
    sink = _PushSink(room, Metrics(), pins)
    t = torch.ones(2, 4)
    alive = weakref.ref(t)
    sink.on_item(result(1, t, released))
    sink.on_item(result(0, torch.zeros(2, 4), released))
    del t
    sink.on_finish(Outcome("r", "done"))
    assert sink.items == [] and cache.pin_count(b"k" * 32) == 0
    assert [o.embedding.sum().item() for o in room.delivered] == [0.0, 8.0]  # item order
    room.release()
    assert sorted(released) == [0, 1]
    room.delivered = room.release = None
    gc.collect()
    assert alive() is None  # nothing in the front still holds the output


def test_push_sink_failure_releases_and_fails_the_room():
    room, released = Room(), []
    sink = _PushSink(room, Metrics(), Pins(EmbeddingCache(capacity_bytes=1024)))
    sink.on_item(result(0, torch.zeros(1, 1), released))
    sink.on_finish(Outcome("r", "failed", RequestTimeout("late")))
    assert isinstance(room.failed, RequestTimeout) and released == [0] and sink.items == []


def test_b64_forms_and_limits():
    raw = b"\x89PNG....."
    enc = base64.b64encode(raw).decode()
    assert _b64(enc, 100) == raw and _b64(f"data:image/png;base64,{enc}", 100) == raw
    with pytest.raises(InvalidBase64):
        _b64("data:image/png,notbase64", 100)
    with pytest.raises(InvalidBase64):
        _b64("!!!!", 100)
    with pytest.raises(ImageTooLarge):
        _b64("A" * 200, 100)  # refused before decoding


def test_pins_refuse_takes_after_release():
    cache = EmbeddingCache(capacity_bytes=1024)
    cache.put(b"k" * 32, "v", 1)
    pins = Pins(cache)
    assert pins.take(b"k" * 32)
    pins.release()
    with pytest.raises(Cancelled):
        pins.take(b"k" * 32)
    assert cache.pin_count(b"k" * 32) == 0


# -- the request path with a fake engine and preprocessor ------------------------

class Engine:
    """Accepts every request and finishes it at once (the front's view of a fast engine)."""

    def __init__(self):
        self.requests = []

    def precheck(self, rid, charge=None):
        pass

    def submit(self, request, sink, **_):
        self.requests.append(request)
        sink.on_finish(Outcome(request.request_id, "done"))

    def cancel(self, rid):
        pass

    def fail(self, rid, error):
        pass


BAD = (56, 56)  # images of this size fail in ``stage`` once ``Pre.fail`` is set


class Pre:
    """A preprocessor whose ``stage`` counts its calls and waits on ``gate``."""

    def __init__(self):
        self.gate, self.fail, self.lock = threading.Event(), threading.Event(), threading.Lock()
        self.gate.set()
        self.started = self.running = self.predicted = 0
        self.bytes_per_pixel = 3

    def resolve(self, **_):
        return {"min_pixels": 1}

    def predict(self, width, height, **_):
        self.predicted += 1
        return (1, height // 14, width // 14), 1

    def stage_bytes(self, width, height, grid):
        return width * height * self.bytes_per_pixel

    def stage(self, image, **_):
        with self.lock:
            self.started += 1
            self.running += 1
        try:
            if image.size == BAD:
                self.fail.wait(10)
                raise UndecodableImage("corrupt pixels")
            self.gate.wait(10)
            w, h = image.size
            rows = (w // 14) * (h // 14)
            return StagedImage(torch.zeros(rows, dtype=torch.uint8), (1, h // 14, w // 14), rows)
        finally:
            with self.lock:
                self.running -= 1


def staged_bytes(size):
    return (size[0] // 14) * (size[1] // 14)  # what the fake's stage holds, in bytes


def make_front(workers=2, pre=None, limits=LimitsConfig(), **kw):
    cache = EmbeddingCache(capacity_bytes=1 << 20)
    front = EncodeFront(engine=Engine(), cache=cache, preprocessor=pre or Pre(), model_id="m",
                        revision="r", limits=limits, metrics=Metrics(), request_timeout=10,
                        workers=workers, **kw)
    return front, cache


def png(seed, size=(28, 42)):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def items(*images):
    return EncodeBody(items=[{"type": "image", "image": i if isinstance(i, str) else base64.b64encode(i).decode()}
                             for i in images])


async def until(condition, timeout=10.0):
    """Poll ``condition`` on the event loop until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def settled():
    """Every other task on this loop has ended (no item of a past request still runs)."""
    me = asyncio.current_task()
    await until(lambda: all(t is me for t in asyncio.all_tasks()))


def test_a_failed_item_leaves_no_pin_from_its_siblings():
    async def main():
        front, cache = make_front()
        data = png(1)
        key = front._context(front.pre.resolve()).key(data)
        cache.put(key, "cached", 1)
        for _ in range(5):
            with pytest.raises(InvalidBase64):
                await front.encode(items("!!!!", data))
        await settled()
        assert cache.pin_count(key) == 0
        await front.encode(items(data))  # a later hit pins and releases as usual
        assert cache.pin_count(key) == 0
        front.close()

    asyncio.run(main())


async def pool_drained(front):
    """Every pool job queued so far has ended or was cancelled (the pool is FIFO)."""
    await asyncio.wrap_future(front.pool.submit(lambda: None))


def test_a_failed_request_counts_its_running_jobs_until_they_end():
    async def main():
        pre = Pre()
        front, _ = make_front(workers=16, pre=pre)
        pre.gate.clear()
        task = asyncio.ensure_future(front.encode(items(png(0, BAD), *(png(i) for i in range(1, 13)))))
        await until(lambda: pre.running == 13)
        pre.fail.set()
        with pytest.raises(UndecodableImage):
            await task
        # The twelve siblings cannot be stopped mid-decode: they still count.
        assert pre.running == 12 and front._preprocessing == 12
        pre.gate.set()
        await until(lambda: front._preprocessing == 0)
        assert pre.running == 0 and pre.started == 13
        front.close()

    asyncio.run(main())


def test_a_cancelled_request_drops_its_queued_jobs():
    async def main():
        pre = Pre()
        front, _ = make_front(workers=2, pre=pre)
        pre.gate.clear()
        task = asyncio.ensure_future(front.encode(items(*(png(i) for i in range(6)))))
        await until(lambda: pre.running == 2)  # both threads busy, four stage jobs queued
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert front._preprocessing == 2
        pre.gate.set()
        await until(lambda: front._preprocessing == 0)
        await pool_drained(front)
        assert pre.started == 2  # the queued jobs never ran
        front.close()

    asyncio.run(main())


def test_a_shared_staging_job_outlives_a_failed_duplicate():
    async def main():
        pre = Pre()
        front, _ = make_front(workers=4, pre=pre)
        pre.gate.clear()
        shared = png(1)
        failing = asyncio.ensure_future(front.encode(items(shared, png(0, BAD))))
        await until(lambda: pre.running == 2)
        waiting = asyncio.ensure_future(front.encode(items(shared)))
        await until(lambda: pre.predicted == 3)  # the duplicate waits on the running job
        pre.fail.set()
        with pytest.raises(UndecodableImage):
            await failing
        assert front._preprocessing == 1 and pre.running == 1
        pre.gate.set()
        encoded = await waiting
        assert encoded.grids == [(1, 2, 3)] and pre.started == 2
        assert front._preprocessing == 0
        front.close()

    asyncio.run(main())


# -- the decoded-bytes budget ------------------------------------------------------

MiB = 1 << 20
BIG = (512, 512)  # 768 KiB predicted (the fake charges width x height x 3)


def test_decoded_bytes_in_flight_stay_within_the_budget_across_requests():
    async def main():
        pre = Pre()
        # Room for two BIG images; eight threads would otherwise decode all six at once.
        front, _ = make_front(workers=8, pre=pre, limits=LimitsConfig(max_decoded_mb=2))
        pre.gate.clear()
        tasks = [asyncio.ensure_future(front.encode(items(*(png(3 * r + i, BIG) for i in range(3)))))
                 for r in range(2)]
        await until(lambda: pre.running == 2 and front.decoded.waiting == 4)
        assert front.decoded.used == 2 * 512 * 512 * 3 and pre.started == 2
        pre.gate.set()
        done = await asyncio.gather(*tasks)
        assert [len(e.grids) for e in done] == [3, 3] and pre.started == 6
        assert front.decoded.peak <= 2 * MiB
        await until(lambda: front.decoded.used == 0 and front._preprocessing == 0)
        front.close()

    asyncio.run(main())


def test_an_image_over_the_whole_budget_runs_alone():
    async def main():
        pre, trims = Pre(), []
        front, _ = make_front(workers=4, pre=pre, limits=LimitsConfig(max_decoded_mb=1),
                              trim=lambda: trims.append(1))
        pre.gate.clear()
        huge = asyncio.ensure_future(front.encode(items(png(1, (1024, 1024)))))  # 3 MiB > 1 MiB
        await until(lambda: pre.running == 1)
        small = asyncio.ensure_future(front.encode(items(png(2))))
        await until(lambda: front.decoded.waiting == 1)  # it waits for the huge one, not beside it
        assert pre.running == 1 and front.decoded.used == 1024 * 1024 * 3
        pre.gate.set()
        await asyncio.gather(huge, small)
        # The huge one's staged pixels are held before its decode charge goes.
        assert pre.started == 2 and front.decoded.peak == 1024 * 1024 * 3 + staged_bytes((1024, 1024))
        await until(lambda: front.decoded.used == 0)
        front.close()

    asyncio.run(main())


def test_a_request_cancelled_while_waiting_for_the_budget_charges_nothing():
    async def main():
        pre = Pre()
        front, _ = make_front(workers=4, pre=pre, limits=LimitsConfig(max_decoded_mb=1))
        pre.gate.clear()
        first = asyncio.ensure_future(front.encode(items(png(1, BIG))))
        await until(lambda: pre.running == 1)
        waiting = asyncio.ensure_future(front.encode(items(png(2, BIG), png(3, BIG))))
        await until(lambda: front.decoded.waiting == 2)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert front.decoded.waiting == 0 and front.decoded.used == 512 * 512 * 3
        assert front._staging.keys() == {front._context(front.pre.resolve()).key(png(1, BIG))}
        pre.gate.set()
        await first
        await until(lambda: front.decoded.used == 0 and front._preprocessing == 0)
        assert pre.started == 1  # the cancelled items were never decoded
        front.close()

    asyncio.run(main())


def test_the_allocator_is_trimmed_when_decoding_drains_after_64_mib_freed():
    async def main():
        pre, trimmed = Pre(), threading.Event()
        front, _ = make_front(workers=2, pre=pre, trim=trimmed.set)
        await front.encode(items(png(1, (64, 64))))  # 12 KiB: no trim
        await pool_drained(front)
        assert not trimmed.is_set()
        pre.bytes_per_pixel = 300
        await front.encode(items(png(2, BIG)))  # 75 MiB predicted, then freed
        assert await asyncio.get_running_loop().run_in_executor(None, trimmed.wait, 10)
        trimmed.clear()
        pre.bytes_per_pixel = 130  # 32.5 MiB each: two small drains add up to the next trim
        await front.encode(items(png(3, BIG)))
        await pool_drained(front)
        assert not trimmed.is_set()
        await front.encode(items(png(4, BIG)))  # within a second of the last trim: deferred, not lost
        assert await asyncio.get_running_loop().run_in_executor(None, trimmed.wait, 10)
        front.close()

    asyncio.run(main())



def test_a_pinned_hit_names_its_tier():
    from types import SimpleNamespace

    from epd_encoder.cache.tiered import TieredEmbeddingCache

    tiered = TieredEmbeddingCache(l1_capacity_bytes=10, l2_capacity_bytes=10, admission="lru")
    tiered.put(b"a" * 32, "A", 10)
    tiered.put(b"b" * 32, "B", 10)  # a goes down to L2
    single = EmbeddingCache(capacity_bytes=10)
    single.put(b"a" * 32, "A", 10)
    tier = EncodeFront._tier
    assert tier(SimpleNamespace(cache=tiered), b"a" * 32) == "host"
    assert tier(SimpleNamespace(cache=tiered), b"b" * 32) == "device"
    assert tier(SimpleNamespace(cache=single), b"a" * 32) == "device"  # one tier: L1
