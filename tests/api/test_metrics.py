# SPDX-License-Identifier: Apache-2.0
"""The cache collector: each series reads the right counter of the right tier, pins included."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from epd_encoder.api.metrics import Metrics
from epd_encoder.engine.cache import EmbeddingCache
from epd_encoder.engine.tiered_cache import TieredEmbeddingCache


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
