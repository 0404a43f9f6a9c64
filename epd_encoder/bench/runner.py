# SPDX-License-Identifier: Apache-2.0
"""A bench run: every target (ours, then each baseline) through every load point.

Each target is a running server (a URL) or one started here (server.py) and stopped
after its points. Before its points a target gets ``warmup`` requests of their own
content (namespace 0), one at a time. Point ``k`` plans its requests in namespace
``k + 1``: every target sees the same requests at the same point, and a point's unique
images are new to a server that already ran the earlier points.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np

from epd_encoder.bench.deliver import Push, make_deliverer
from epd_encoder.bench.load import LoadPoint, run_point
from epd_encoder.bench.media import MediaSource
from epd_encoder.bench.scrape import scrape, server_delta
from epd_encoder.bench.server import ServerProcess, free_port
from epd_encoder.bench.stats import summarize
from epd_encoder.bench.workload import PlannedRequest, WorkloadSpec, iter_plan, poisson_arrivals


@dataclass(frozen=True)
class Target:
    """``url`` for a running server, or ``command(port)`` to start one."""

    name: str
    url: str | None = None
    command: Callable[[int], list[str]] | None = None
    delivery: str | None = None  # None: the run's; the naive baseline answers inline only
    note: str = ""


@dataclass(frozen=True)
class RunSpec:
    workload: WorkloadSpec
    points: tuple[LoadPoint, ...]
    num_requests: int | None = None
    duration: float | None = None
    seed: int = 0
    delivery: str = "inline"
    warmup: int = 4
    timeout: float = 300.0
    push_backend: str = "tcp"
    push_pool_bytes: int = 256 << 20
    trace: tuple[PlannedRequest, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # request fields besides items (video_options)
    progress: bool = True
    prefetch: int = 2000  # requests rendered before a point starts, at most

    def requests(self, namespace: int) -> Iterator[PlannedRequest]:
        return iter(self.trace) if self.trace is not None else iter_plan(self.workload, self.seed, namespace)

    def planned(self, point: LoadPoint) -> int:
        """How many requests a point will send, as far as known before it runs."""
        if self.trace is not None:
            return min(len(self.trace), self.num_requests or len(self.trace))
        if self.num_requests is not None:
            return self.num_requests
        assert self.duration is not None
        if point.mode == "rate":
            return math.ceil(point.value * self.duration * 1.2) + 10
        return int(point.value) * 8  # closed loop for a duration: the rest render during the run

    def arrivals(self, point: LoadPoint, index: int) -> list[float] | None:
        if point.mode == "trace":
            assert self.trace is not None
            return [r.at or 0.0 for r in self.trace]
        if point.mode == "rate":
            rng = np.random.default_rng([self.seed, index + 1, 7])
            return poisson_arrivals(point.value, rng, n=self.num_requests,
                                    duration=None if self.num_requests else self.duration)
        return None


class _Bar:
    def __init__(self, total: int | None, desc: str, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _info(client: httpx.AsyncClient) -> dict | None:
    try:
        r = await client.get("/info")
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def measure(url: str, target: Target, spec: RunSpec, source: MediaSource) -> dict:
    """Warm ``url`` up and run every load point against it."""
    mode = target.delivery or spec.delivery
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=spec.timeout,
                                                                   limits=limits))
        receiver = None
        if mode == "push":
            from epd_encoder.receiver import EmbeddingReceiver

            receiver = stack.enter_context(EmbeddingReceiver(backend=spec.push_backend,
                                                             pool_bytes=spec.push_pool_bytes))
        deliver = make_deliverer(mode, receiver=receiver, timeout=spec.timeout)
        if isinstance(deliver, Push):
            stack.callback(deliver.close)
        info = await _info(client)
        for i, req in enumerate(itertools.islice(iter_plan(spec.workload, spec.seed, 0), spec.warmup)):
            out = await deliver(client, f"warmup-{target.name}-{i}", source.items(req), spec.extra)
            if not out.ok:
                raise RuntimeError(f"{target.name}: warm-up request failed: {out.status} {out.error}")
        points = []
        for k, point in enumerate(spec.points):
            ahead = itertools.islice(spec.requests(k + 1), min(spec.planned(point), spec.prefetch))
            await asyncio.to_thread(lambda: [source.items(r) for r in ahead])
            before = await scrape(client)
            bar = _Bar(spec.planned(point) if spec.num_requests or point.mode != "concurrency" else None,
                       f"{target.name} {point.label()}", spec.progress)
            try:
                run = await run_point(client, deliver, source, spec.requests(k + 1), point,
                                      num_requests=spec.num_requests, duration=spec.duration,
                                      arrivals=spec.arrivals(point, k), progress=bar,
                                      id_prefix=f"{target.name}-{k}", extra=spec.extra)
            finally:
                bar.close()
            after = await scrape(client)
            points.append({"load": {"mode": point.mode, "value": point.value}, **summarize(run),
                           "server": server_delta(before, after)})
        return {"name": target.name, "url": url, "delivery": mode, "note": target.note, "info": info,
                "points": points}


def run_target(target: Target, spec: RunSpec, source: MediaSource, log_dir: Path) -> dict:
    if target.url is not None:
        return asyncio.run(measure(target.url, target, spec, source))
    assert target.command is not None
    port = free_port()
    with ServerProcess(target.command(port), port, log_dir / f"{target.name}.log") as srv:
        out = asyncio.run(measure(srv.url, target, spec, source))
    out["log"] = str(srv.log)
    return out


def ratios(ours: dict, base: dict) -> list[dict]:
    """Per load point: throughput ours/baseline (above 1: ours is faster) and p99 latency
    to embeddings ours/baseline (below 1: ours is lower)."""
    out = []
    for a, b in zip(ours["points"], base["points"]):
        ta, tb = a["throughput"]["items_per_s"], b["throughput"]["items_per_s"]
        pa, pb = a["latency_ms"]["embeddings"]["p99"], b["latency_ms"]["embeddings"]["p99"]
        out.append({"load": a["load"], "throughput": ta / tb if tb else None,
                    "p99_embeddings": pa / pb if pa is not None and pb else None})
    return out
