# SPDX-License-Identifier: Apache-2.0
"""The load loops: closed (N clients back to back) or open (arrivals at planned times).

A run stops issuing at ``num_requests`` or after ``duration`` seconds, then lets every
request already sent finish; the wall time ends with the last answer. Latency is from
the send, so rendering media late (off the event loop, see ``MediaSource``) never counts
as server time. Open-loop sends that start later than planned are counted as ``late``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Protocol

import httpx

from epd_encoder.bench.deliver import Deliverer, Outcome
from epd_encoder.bench.media import ItemSource
from epd_encoder.bench.workload import PlannedRequest


@dataclass(frozen=True)
class LoadPoint:
    """``concurrency`` N clients, Poisson ``rate`` R/s, or a ``trace``'s own timestamps."""

    mode: Literal["concurrency", "rate", "trace"]
    value: float

    def label(self) -> str:
        return {"concurrency": f"c={self.value:g}", "rate": f"{self.value:g}/s", "trace": "trace"}[self.mode]


class Progress(Protocol):
    def update(self, n: int = 1) -> object: ...


@dataclass
class PointRun:
    done: list[tuple[PlannedRequest, Outcome]]
    wall_s: float
    late: int = 0  # open loop: sends that started over 10 ms after their planned time


async def run_point(client: httpx.AsyncClient, deliver: Deliverer, source: ItemSource,
                    requests: Iterable[PlannedRequest], point: LoadPoint, *, num_requests: int | None,
                    duration: float | None, arrivals: Iterable[float] | None = None, progress: Progress,
                    id_prefix: str, extra: dict[str, Any] | None = None) -> PointRun:
    """Run one load point. ``arrivals`` (s from the start) drive an open loop; else closed."""
    reqs = enumerate(itertools.islice(requests, num_requests))
    done: list[tuple[PlannedRequest, Outcome]] = []
    t0 = time.perf_counter()
    stop = t0 + duration if duration is not None else float("inf")

    async def one(i: int, req: PlannedRequest) -> None:
        items = source.items(req) if source.ready(req) else await asyncio.to_thread(source.items, req)
        done.append((req, await deliver(client, f"{id_prefix}-{i}", items, extra or {})))
        progress.update(1)

    late = 0
    if arrivals is None:
        async def worker() -> None:
            for i, req in reqs:  # one iterator shared by every worker
                if time.perf_counter() >= stop:
                    return
                await one(i, req)

        await asyncio.gather(*(worker() for _ in range(int(point.value))))
    else:
        tasks = []
        for (i, req), at in zip(reqs, arrivals):
            if t0 + at >= stop:
                break
            if (delay := t0 + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            late += delay < -0.01
            tasks.append(asyncio.create_task(one(i, req)))
        await asyncio.gather(*tasks)
    return PointRun(done, time.perf_counter() - t0, late)
