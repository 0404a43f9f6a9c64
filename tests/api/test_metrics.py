# SPDX-License-Identifier: Apache-2.0
"""The cache collector: each series reads the right counter of the right tier, pins included."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_encoder.api.metrics import Metrics
from epd_encoder.cache.lru import EmbeddingCache
from epd_encoder.cache.tiered import TieredEmbeddingCache


def samples(m: Metrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}


def bound(cache) -> Metrics:
    m = Metrics()
    m.bind(cache=cache, queue_depth=lambda: 0, pending_cost=lambda: 0, coalesced=lambda: 0)
    return m


def tier(name: str, t: str) -> tuple:
    return (name, (("tier", t),))


def test_tiered_counters_land_on_their_own_tier():
    cache = TieredEmbeddingCache(l1_capacity_bytes=100, l2_capacity_bytes=50)
    m = bound(cache)
    for key, nbytes in (("a", 60), ("b", 30), ("c", 30)):  # a: L1's victim, too big for L2
        cache.put(key, key.upper(), nbytes)
    cache.put("d", "D", 30)
    cache.put("e", "E", 30)  # b goes down to L2
    cache.put("huge", "H", 200)  # fits neither tier
    assert cache.get("a") is None  # a miss in both tiers
    assert cache.get("b") == "B"  # an L2 hit, promoted: c goes down
    assert cache.get("e") == "E"  # an L1 hit
    cache.put("f", "F", 30)  # d goes down, L2 drops c for it
    got = samples(m)
    expected = {
        "l1": dict(hits=1, misses=2, evictions=1, demotions=3, rejected=1, bytes=90),
        "l2": dict(hits=1, misses=1, evictions=1, demotions=0, rejected=2, bytes=30),
    }
    for t, counts in expected.items():
        for what, n in counts.items():
            name = "epd_cache_bytes" if what == "bytes" else f"epd_cache_{what}_total"
            assert got[tier(name, t)] == n, (name, t)


def test_pinned_gauges_follow_pins_and_return_to_zero():
    cache = EmbeddingCache(capacity_bytes=100)
    m = bound(cache)
    cache.put("a", "A", 40)
    cache.put("b", "B", 25)
    assert cache.acquire("a") == "A" and cache.pin("a") and cache.pin("b")
    got = samples(m)
    assert got[("epd_cache_pinned_entries", ())] == 2 and got[("epd_cache_pinned_bytes", ())] == 65
    cache.discard("b")  # still pinned, no longer stored: a held key, no bytes
    got = samples(m)
    assert got[("epd_cache_pinned_entries", ())] == 2 and got[("epd_cache_pinned_bytes", ())] == 40
    for key in ("a", "a", "b"):
        cache.release(key)
    got = samples(m)
    assert got[("epd_cache_pinned_entries", ())] == 0 and got[("epd_cache_pinned_bytes", ())] == 0
    assert cache.pinned_stats().entries == 0 == cache.pinned_stats().bytes


# -- naming: Prometheus conventions over every series a bound server exports ---------------
UNITS = ("_seconds", "_bytes", "_ratio", "_patches", "_items", "_entries", "_info")


def families(m: Metrics) -> dict:
    return {fam.name: fam for fam in text_string_to_metric_families(m.render().decode())}


def test_every_epd_series_follows_the_prometheus_naming_rules():
    m = bound(EmbeddingCache(capacity_bytes=100))
    m.push.room_ended("done", 0.01)
    m.observe_request("/health", "GET", 200, 0.0)
    fams = families(m)
    # ``*_created`` (a counter's or histogram's start time) parse as gauges of their own.
    ours = {name: fam for name, fam in fams.items() if name.startswith("epd_") and not name.endswith("_created")}
    assert len(ours) >= 20
    for name, fam in ours.items():
        if fam.type == "counter":  # the parser strips _total from the family; the samples carry it
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), name
        else:
            assert name.endswith(UNITS), f"{name} ({fam.type}) names no unit"
            assert not name.endswith("_total"), f"{name} is a {fam.type}, not a counter"
    assert fams["epd_coalesced"].type == "counter"
    # The default process and platform collectors, on this registry.
    assert {"process_resident_memory_bytes", "process_open_fds", "python_info"} <= fams.keys() | {
        s.name for fam in fams.values() for s in fam.samples}
    assert any(name.startswith("python_gc") for name in fams)


def test_coalesced_is_a_counter_of_the_workers_cumulative_count():
    count = [0]
    m = Metrics()
    m.bind(cache=EmbeddingCache(capacity_bytes=100), queue_depth=lambda: 3, pending_cost=lambda: 7,
           coalesced=lambda: count[0])
    count[0] = 5
    got = samples(m)
    assert got[("epd_coalesced_total", ())] == 5
    assert got[("epd_queued_items", ())] == 3 and got[("epd_pending_cost_patches", ())] == 7


def test_two_servers_in_one_process_each_have_their_own_process_metrics():
    # Each registry gets its own collectors: the global registry is never touched.
    a, b = Metrics(), Metrics()
    assert b"process_resident_memory_bytes" in a.render() and b"process_resident_memory_bytes" in b.render()


def test_push_observer_counts_rooms_by_outcome_bytes_and_transfer_time():
    m = Metrics()
    m.push.bytes_sent(1000)
    m.push.bytes_sent(24)
    m.push.room_ended("done", 0.2)
    m.push.room_ended("timeout", None)  # a failed room: counted, not timed
    got = samples(m)
    assert got[("epd_push_bytes_total", ())] == 1024
    assert got[("epd_push_rooms_total", (("outcome", "done"),))] == 1
    assert got[("epd_push_rooms_total", (("outcome", "timeout"),))] == 1
    assert got[("epd_push_transfer_seconds_count", ())] == 1
    assert got[("epd_push_transfer_seconds_sum", ())] == pytest.approx(0.2)


# -- per-route latency: the route template, never the raw path ---------------------------
def _app(metrics: Metrics):
    from fastapi import FastAPI
    from fastapi.responses import Response

    from epd_encoder.api.middleware import RequestMetrics

    app = FastAPI()

    @app.get("/v1/embeddings/{key}")
    async def get(key: str):
        return Response(status_code=404 if key == "gone" else 200)

    app.add_middleware(RequestMetrics, metrics=metrics)
    return app


def test_request_latency_is_labelled_by_route_template_method_and_status_class():
    from fastapi.testclient import TestClient

    m = Metrics()
    with TestClient(_app(m)) as c:
        for key in ("a1", "b2", "c3", "gone"):
            c.get(f"/v1/embeddings/{key}")
        c.request("BREW", "/v1/embeddings/x")  # a made-up method: 'other', not a new series
        c.get("/no/such/path")
    got = samples(m)
    count = lambda **lb: got.get(("epd_request_duration_seconds_count", tuple(sorted(lb.items()))))  # noqa: E731
    route = "/v1/embeddings/{key}"
    assert count(route=route, method="GET", status_class="2xx") == 3
    assert count(route=route, method="GET", status_class="4xx") == 1
    assert count(route=route, method="other", status_class="4xx") == 1  # 405
    assert count(route="unmatched", method="GET", status_class="4xx") == 1
    assert got[("epd_requests_total", (("route", route), ("status", "200")))] == 3
    paths = {dict(k[1]).get("route") for k in got if k[0].startswith("epd_request")}
    assert paths == {route, "unmatched"}, paths  # never a raw path
    assert got[("epd_request_duration_seconds_sum", (("method", "GET"), ("route", route),
                                                      ("status_class", "2xx")))] > 0


def test_the_shared_tier_reports_on_the_cache_series_and_its_own():
    from types import SimpleNamespace

    from epd_encoder.cache.shared import SharedStats

    stats = SharedStats(hits=3, misses=4, corrupt=1, bytes_read=10, bytes_written=20, writes=2, removals=1,
                        errors={("get", "timeout"): 5}, dropped={"queue_full": 6})
    store = SimpleNamespace(connected=False, breaker=SimpleNamespace(state="open"))
    m = bound(EmbeddingCache(capacity_bytes=100))
    m.bind_shared(SimpleNamespace(stats=stats, store=store, queued_writes=7))
    got = samples(m)
    assert got[tier("epd_cache_hits_total", "shared")] == 3 and got[tier("epd_cache_misses_total", "shared")] == 4
    assert got[("epd_shared_cache_errors_total", (("op", "get"), ("reason", "timeout")))] == 5
    assert got[("epd_shared_cache_writes_dropped_total", (("reason", "queue_full"),))] == 6
    assert got[("epd_shared_cache_bytes_total", (("direction", "written"),))] == 20
    assert got[("epd_shared_cache_write_queue_items", ())] == 7
    state = {s: got[("epd_shared_cache_breaker_info", (("state", s),))] for s in ("down", "closed", "open", "half_open")}
    assert state == {"down": 1, "closed": 0, "open": 0, "half_open": 0}  # not connected yet: down
    store.connected = True
    assert samples(m)[("epd_shared_cache_breaker_info", (("state", "open"),))] == 1
    for name, fam in families(m).items():  # the naming rules above, on the shared tier's series
        if name.startswith("epd_shared_cache") and not name.endswith("_created"):
            assert fam.type == "counter" or name.endswith(UNITS), name
