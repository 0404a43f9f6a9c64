# SPDX-License-Identifier: Apache-2.0
"""Assemble the engine (scheduler, cache, worker, loop) from the config tree."""

from __future__ import annotations

from typing import Any, Callable

from epd_encoder.config import EngineConfig
from epd_encoder.cache.lru import EmbeddingCache
from epd_encoder.cache.tiered import TieredEmbeddingCache
from epd_encoder.engine.loop import EngineLoop
from epd_encoder.engine.reference_scheduler import ReferenceScheduler
from epd_encoder.engine.scheduler import EncodeScheduler
from epd_encoder.engine.worker import EncodeWorker, Executor


def build_cache(
    config: EngineConfig,
    *,
    to_host: Callable[[Any], Any] | None = None,
    to_device: Callable[[Any], Any] | None = None,
):
    c = config.cache
    if c.l2_bytes > 0:
        return TieredEmbeddingCache(
            l1_capacity_bytes=c.l1_bytes, l2_capacity_bytes=c.l2_bytes,
            to_host=to_host, to_device=to_device, admission=c.admission,
        )
    return EmbeddingCache(capacity_bytes=c.l1_bytes, admission=c.admission)


def build_scheduler(config: EngineConfig) -> EncodeScheduler | ReferenceScheduler:
    s = config.scheduler
    if s.scheduling == "reference":
        return ReferenceScheduler(max_batch_cost=s.max_batch_cost, max_batch_items=s.max_batch_items)
    return EncodeScheduler(
        max_batch_cost=s.max_batch_cost, max_batch_items=s.max_batch_items,
        lookahead=s.lookahead, max_skips=s.max_skips, max_wait_s=s.max_wait_ms / 1000.0,
    )


def build_engine(config: EngineConfig, executor: Executor, cache=None, *,
                 wrap_scheduler: Callable[[Any], Any] | None = None) -> EngineLoop:
    """A started-ready (not started) EngineLoop around ``executor``. ``wrap_scheduler``
    wraps the scheduler the worker drives (``--tp``: ``tp.replica.RecordingScheduler``)."""
    scheduler = build_scheduler(config)
    if wrap_scheduler is not None:
        scheduler = wrap_scheduler(scheduler)
    cache = cache if cache is not None else build_cache(config)

    def make_worker(deliverer) -> EncodeWorker:
        # The reference baseline coalesces nothing (docs/scheduler.md, "Reference scheduling").
        return EncodeWorker(executor=executor, scheduler=scheduler, cache=cache, deliverer=deliverer,
                            coalesce=config.scheduler.scheduling != "reference")

    return EngineLoop(make_worker, max_pending_cost=config.max_pending_cost,
                      wait_hint=scheduler.time_until_ready)
