# SPDX-License-Identifier: Apache-2.0
"""server/staging.py through the front, with a real engine: one staged copy per key for
every request holding it, charged to the byte budget until the last of them ends."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from epd_encoder.api.metrics import Metrics
from epd_encoder.config import LimitsConfig
from epd_encoder.cache.lru import EmbeddingCache
from epd_encoder.errors import RequestTimeout
from epd_encoder.server.front import EncodeFront
from epd_encoder.types import ItemOutput
from tests.server.test_front import Pre, items, png, staged_bytes, until


class HeldExecutor:
    """Encodes each staged source to a tensor of its key; waits on ``gate`` first."""

    def __init__(self):
        self.gate, self.entered, self.payloads = threading.Event(), threading.Event(), []

    def encode(self, payloads):
        self.entered.set()
        assert self.gate.wait(10)
        self.payloads.extend(payloads)
        return [ItemOutput(torch.full((2, 4), float(p.key[0]) + p.get().pixels.numel())) for p in payloads]


def make_engine_front(executor, pre, *, max_pending_cost=None, coalesce=True, timeout=10):
    from epd_encoder.engine.loop import EngineLoop
    from epd_encoder.engine.scheduler import EncodeScheduler
    from epd_encoder.engine.worker import EncodeWorker

    cache = EmbeddingCache(capacity_bytes=1 << 20)
    engine = EngineLoop(lambda d: EncodeWorker(executor=executor, scheduler=EncodeScheduler(), cache=cache,
                                                deliverer=d, coalesce=coalesce),
                        max_pending_cost=max_pending_cost, idle_wait_s=0.05).start()
    front = EncodeFront(engine=engine, cache=cache, preprocessor=pre, model_id="m", revision="r",
                        limits=LimitsConfig(), metrics=Metrics(), request_timeout=timeout, workers=4)
    return front, engine


def test_duplicates_of_a_queued_key_share_one_decode_and_one_charge():
    async def main():
        pre, ex = Pre(), HeldExecutor()
        front, engine = make_engine_front(ex, pre, max_pending_cost=200)
        ex.gate.set()
        gate, holding = threading.Event(), threading.Event()
        engine.call(lambda _w: (holding.set(), gate.wait(10)))  # the engine is held
        assert holding.wait(5)
        data, n = png(7), 21
        tasks = []
        for i in range(n):  # one after another: each is queued before the next arrives
            tasks.append(asyncio.ensure_future(front.encode(items(data))))
            await until(lambda: engine.active_requests == i + 1)
        assert pre.started == 1  # one decode for all 21
        assert engine.outstanding_cost == 6 and front.decoded.used == staged_bytes((28, 42))
        gate.set()
        done = await asyncio.gather(*tasks)
        outputs = [e.result.items[0].output.embedding for e in done]
        assert all(torch.equal(o, outputs[0]) for o in outputs) and len(ex.payloads) == 1
        for e in done:
            e.result.release()
        assert front.decoded.used == 0 and not front._staging
        engine.stop()
        front.close()

    asyncio.run(main())


def test_a_duplicate_arriving_after_staging_reuses_the_staged_pixels():
    async def main():
        pre, ex = Pre(), HeldExecutor()
        front, engine = make_engine_front(ex, pre)
        first = asyncio.ensure_future(front.encode(items(png(3))))
        assert await asyncio.get_running_loop().run_in_executor(None, ex.entered.wait, 10)  # in the forward
        second = asyncio.ensure_future(front.encode(items(png(3))))
        await until(lambda: engine.active_requests == 2)
        assert pre.started == 1 and front.decoded.used == staged_bytes((28, 42))
        ex.gate.set()
        a, b = await asyncio.gather(first, second)
        assert torch.equal(a.result.items[0].output.embedding, b.result.items[0].output.embedding)
        a.result.release(), b.result.release()
        assert front.decoded.used == 0 and pre.started == 1
        engine.stop()
        front.close()

    asyncio.run(main())


def test_a_timed_out_request_holds_its_pixels_until_the_engine_ends_it():
    async def main():
        pre, ex = Pre(), HeldExecutor()
        ex.gate.set()
        front, engine = make_engine_front(ex, pre, timeout=0.5)
        gate, holding = threading.Event(), threading.Event()
        engine.call(lambda _w: (holding.set(), gate.wait(10)))  # the engine is held past the timeout
        assert holding.wait(5)
        with pytest.raises(RequestTimeout):
            await front.encode(items(png(9)))
        # Queued still: the engine may yet stage or encode it, so nothing is dropped under it.
        assert front.decoded.held == staged_bytes((28, 42)) and len(front._staging) == 1
        gate.set()  # the engine applies the timeout: the request ends, exactly once
        await until(lambda: front.decoded.used == 0 and not front._staging)
        assert engine.active_requests == 0 and ex.payloads == []
        engine.stop()
        front.close()

    asyncio.run(main())


def test_a_failed_staging_fails_every_holder_and_is_never_joined_again():
    async def main():
        from epd_encoder.errors import UndecodableImage
        from tests.server.test_front import BAD, make_front

        pre = Pre()
        front, _ = make_front(workers=2, pre=pre)
        bad = png(0, BAD)
        first = asyncio.ensure_future(front.encode(items(bad)))
        await until(lambda: pre.running == 1)
        second = asyncio.ensure_future(front.encode(items(bad)))
        await until(lambda: pre.predicted == 2)  # the duplicate joined the running decode
        pre.fail.set()
        for task in (first, second):
            with pytest.raises(UndecodableImage):
                await task
        assert pre.started == 1 and not front._staging and front.decoded.used == 0
        with pytest.raises(UndecodableImage):
            await front.encode(items(bad))  # a new request stages anew
        assert pre.started == 2 and not front._staging and front.decoded.used == 0
        front.close()

    asyncio.run(main())


def test_a_holder_let_go_from_another_thread_is_applied_on_the_loop():
    async def main():
        from concurrent.futures import ThreadPoolExecutor

        from epd_encoder.preprocess.base import StagedImage
        from epd_encoder.server.budget import ByteBudget
        from epd_encoder.server.executor import PixelSource
        from epd_encoder.server.request_work import ItemWork
        from epd_encoder.server.staging import StagingTable

        pool, budget = ThreadPoolExecutor(1), ByteBudget(1 << 20)
        table, loop = StagingTable(pool, budget), asyncio.get_running_loop()
        staged = StagedImage(torch.zeros(10, dtype=torch.uint8), (1, 1, 1), 1)
        source = PixelSource(None, lambda: staged, 1, key=b"k")
        record = table.join(b"k", lambda: source, 100)
        assert await table.wait(record, ItemWork(loop, lambda: None)) is source
        assert source.staged is staged and budget.held == 10 and budget.decoding == 0
        t = threading.Thread(target=table.let_go, args=(loop, record))  # a push sink ends it
        t.start()
        t.join(10)
        assert budget.held == 10 and b"k" in table  # posted to the loop, not applied there
        await until(lambda: budget.held == 0 and b"k" not in table)
        assert source.staged is None  # whoever still refers to the source holds no pixels
        pool.shutdown()

    asyncio.run(main())
