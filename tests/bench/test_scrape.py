# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import asyncio

import httpx
import pytest

from epd_encoder.api.metrics import Metrics
from epd_encoder.bench.scrape import parse, scrape, server_delta


class _Cache:
    class stats:  # noqa: N801  (the shape Metrics reads)
        hits = misses = evictions = demotions = rejected = current_bytes = 0

    def pinned_stats(self):
        class P:
            entries = bytes = 0
        return P()


def _metrics():
    m = Metrics()
    coalesced = [0]
    m.bind(cache=_Cache(), queue_depth=lambda: 0, pending_cost=lambda: 0, coalesced=lambda: coalesced[0])
    return m, coalesced


def test_deltas_from_the_servers_own_metric_names():
    m, coalesced = _metrics()
    m.items.labels("hit").inc(3)
    m.batch_size.observe(2)
    before = parse(m.render().decode())
    m.items.labels("hit").inc(2)
    m.items.labels("miss").inc(5)
    m.items.labels("coalesced").inc(3)
    coalesced[0] = 3
    for size, fill in ((4, 0.5), (2, 0.25)):
        m.batch_size.observe(size)
        m.batch_fill.observe(fill)
    m.forward_s.observe(0.5)
    d = server_delta(before, parse(m.render().decode()))
    assert d["items"] == {"hit": 2, "miss": 5, "coalesced": 3}
    assert d["hit_rate"] == pytest.approx(0.2) and d["coalesced_rate"] == pytest.approx(0.3)
    assert d["coalesced_total"] == 3 and d["batches"] == 2
    assert d["batch_items_mean"] == pytest.approx(3.0) and d["batch_fill_mean"] == pytest.approx(0.375)
    assert d["forward_s_total"] == pytest.approx(0.5)


def test_no_traffic_gives_no_rates():
    m, _ = _metrics()
    s = parse(m.render().decode())
    d = server_delta(s, s)
    assert d["hit_rate"] is None and d["batch_items_mean"] is None
    assert server_delta(None, s) is None


@pytest.mark.parametrize("status,text", [(404, "nope"), (200, "<html>"), (200, "process_cpu_seconds_total 1\n")])
def test_a_server_without_our_metrics_scrapes_as_none(status, text):
    transport = httpx.MockTransport(lambda req: httpx.Response(status, text=text))

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
            return await scrape(c)

    assert asyncio.run(go()) is None
