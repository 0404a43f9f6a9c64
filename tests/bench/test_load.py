# SPDX-License-Identifier: Apache-2.0
"""The loops against a fake deliverer: concurrency bound, arrival times, stop conditions."""

from __future__ import annotations

import asyncio
import time

import pytest

from epd_encoder.bench.deliver import Outcome
from epd_encoder.bench.load import LoadPoint, run_point
from epd_encoder.bench.workload import WorkloadSpec, iter_plan, plan


class FakeDeliver:
    mode = "fake"

    def __init__(self, service_s: float = 0.0) -> None:
        self.service_s, self.in_flight, self.peak, self.sent = service_s, 0, 0, []

    async def __call__(self, client, request_id, items, extra):
        start = time.perf_counter()
        self.sent.append((request_id, start))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.service_s)
        self.in_flight -= 1
        return Outcome(start, "200", 0.0, time.perf_counter() - start)


class Items:
    """An ItemSource that never renders: only the loop is under test."""

    def __init__(self):
        self.calls = 0

    def ready(self, request):
        return True

    def items(self, request):
        self.calls += 1
        return [{"type": "image", "image": ""}]


class Bar:
    def __init__(self):
        self.n = 0

    def update(self, n=1):
        self.n += n


def run(deliver, point, *, requests=None, **kw):
    bar = Bar()
    reqs = requests if requests is not None else iter_plan(WorkloadSpec(), 0, 1)
    out = asyncio.run(run_point(None, deliver, Items(), reqs, point, progress=bar, id_prefix="t", **kw))
    return out, bar


def test_closed_loop_holds_exactly_n_in_flight_and_sends_every_request():
    d = FakeDeliver(0.005)
    out, bar = run(d, LoadPoint("concurrency", 4), num_requests=40, duration=None)
    assert d.peak == 4 and len(out.done) == 40 == bar.n
    assert sorted(rid for rid, _ in d.sent) == sorted(f"t-{i}" for i in range(40))


def test_closed_loop_for_a_duration_stops_sending_then_drains():
    d = FakeDeliver(0.02)
    out, _ = run(d, LoadPoint("concurrency", 2), num_requests=None, duration=0.3)
    assert 10 <= len(out.done) <= 32  # about 0.3 s / 0.02 s * 2, with slack for a loaded CPU
    assert all(o.ok for _, o in out.done) and out.wall_s >= 0.3


def test_open_loop_sends_at_the_planned_times_whatever_the_service_time():
    d = FakeDeliver(0.2)  # slower than the gaps: an open loop does not wait for answers
    arrivals = [0.0, 0.05, 0.1, 0.15]
    out, _ = run(d, LoadPoint("rate", 20), num_requests=4, duration=None, arrivals=arrivals)
    starts = [t - d.sent[0][1] for _, t in d.sent]
    assert starts == pytest.approx(arrivals, abs=0.04) and d.peak == 4
    assert len(out.done) == 4 and out.late == 0


def test_open_loop_for_a_duration_drops_arrivals_after_it():
    d = FakeDeliver(0.0)
    out, _ = run(d, LoadPoint("rate", 10), num_requests=None, duration=0.2, arrivals=[0.0, 0.1, 0.25, 0.3])
    assert len(out.done) == 2


def test_a_finite_request_list_ends_the_loop():
    out, _ = run(FakeDeliver(), LoadPoint("concurrency", 3), requests=iter(plan(WorkloadSpec(), 0, 1, 5)),
                 num_requests=None, duration=10.0)
    assert len(out.done) == 5 and out.wall_s < 5
