# SPDX-License-Identifier: Apache-2.0
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from epd_encoder.engine.cache import PinError, TieredCacheStats
from epd_encoder.engine.tiered_cache import TieredEmbeddingCache

KEYS = [bytes([i]) * 32 for i in range(8)]


class RejectAll:
    def record(self, key):
        pass

    def admit(self, candidate, victims):
        return False


def to_host(value):
    return ("host", value)


def to_device(value):
    tag, inner = value
    assert tag == "host", "to_device got a value that did not come from to_host"
    return inner


def tiered(l1, l2, **kw):
    return TieredEmbeddingCache(
        l1_capacity_bytes=l1, l2_capacity_bytes=l2, to_host=to_host, to_device=to_device, **kw
    )


# --- single tier ---------------------------------------------------------------


# --- tiered -------------------------------------------------------------------


def test_tiered_demotion_and_promotion_go_through_copies():
    c = tiered(2, 4)
    for k in (b"a", b"b", b"c"):
        assert c.put(k, k.upper(), 1)
    assert c.tier_of(b"a") == 2 and c.tier_of(b"c") == 1
    assert c._l2.entries[b"a"][0] == ("host", b"A")
    assert c.get(b"a") == b"A"  # promoted back; b (L1's LRU) demoted
    assert c.tier_of(b"a") == 1 and c.tier_of(b"b") == 2
    s = c.stats
    assert isinstance(s, TieredCacheStats)
    assert (s.l1.demotions, s.l2.promotions, s.l1.hits, s.l2.hits) == (2, 1, 0, 1)
    assert (s.hits, s.misses, s.demotions, s.promotions) == (1, 0, 2, 1)
    assert c.get(b"a") == b"A" and c.stats.l1.hits == 1
    assert c.get(b"zz") is None and c.stats.misses == 1 and c.stats.l1.misses == 2


def test_tiered_copies_default_to_identity():
    c = TieredEmbeddingCache(l1_capacity_bytes=1, l2_capacity_bytes=1, to_host=None)
    v = object()
    c.put(b"a", v, 1)
    c.put(b"b", 0, 1)
    assert c.tier_of(b"a") == 2 and c.get(b"a") is v


def test_tiered_lru_order_within_tiers():
    c = tiered(2, 2)
    c.put(b"a", "A", 1)
    c.put(b"b", "B", 1)
    c.get(b"a")  # an L1 hit refreshes: b is now L1's LRU
    c.put(b"c", "C", 1)
    assert c.tier_of(b"b") == 2 and c.tier_of(b"a") == 1
    c.put(b"d", "D", 1)  # demotes a; L2 now holds b, a
    c.put(b"e", "E", 1)  # demotes c and evicts b, L2's LRU
    assert [c.tier_of(k) for k in (b"a", b"b", b"c", b"d", b"e")] == [2, None, 2, 1, 1]


def test_tiered_unpromotable_l2_hit_refreshes_l2_lru():
    c = tiered(1, 2)
    c.put(b"a", "A", 1)
    c.acquire(b"a")  # L1 pinned full: nothing can be promoted
    c.put(b"b", "B", 1)
    c.put(b"c", "C", 1)
    assert c.get(b"b") == "B" and c.tier_of(b"b") == 2
    c.put(b"d", "D", 1)
    assert c.tier_of(b"c") is None and c.tier_of(b"b") == 2 and c.tier_of(b"a") == 1


def test_tiered_refused_demotion_is_an_l1_eviction():
    c = tiered(1, 1)
    c.put(b"a", "A", 1)
    c.put(b"b", "B", 1)
    assert c.tier_of(b"a") == 2 and c.pin(b"a")
    assert c.put(b"c", "C", 1)  # b cannot demote into the pinned-full L2
    s = c.stats
    assert c.tier_of(b"b") is None and c.tier_of(b"a") == 2 and c.tier_of(b"c") == 1
    assert (s.l1.evictions, s.l1.demotions, s.l2.rejected, s.evictions) == (1, 1, 1, 1)


def test_tiered_capacity_per_tier_and_eviction_from_l2():
    c = tiered(2, 2)
    for i in range(6):
        c.put(bytes([i]), i, 1)
    s = c.stats
    assert s.l1.current_bytes == 2 and s.l2.current_bytes == 2 and len(c) == 4
    assert s.l2.evictions == 2 and s.evictions == 2 and c.current_bytes == 4
    assert [c.tier_of(bytes([i])) for i in range(6)] == [None, None, 2, 2, 1, 1]


def test_tiered_value_too_big_for_l1_goes_to_l2():
    c = tiered(2, 10)
    assert c.put(b"big", "BIG", 5) and c.tier_of(b"big") == 2
    assert c.get(b"big") == "BIG" and c.tier_of(b"big") == 2  # transient device copy
    assert c.stats.l1.rejected == 2
    assert c.put(b"huge", "H", 11) is False and c.stats.rejected == 1


def test_tiered_pinned_l1_entries_are_not_demoted():
    c = tiered(2, 2)
    c.put(b"a", "A", 1)
    c.put(b"b", "B", 1)
    c.acquire(b"a")
    c.acquire(b"b")
    assert c.put(b"c", "C", 1) and c.tier_of(b"c") == 2  # L1 pinned full
    assert c.get(b"c") == "C" and c.tier_of(b"c") == 2
    c.release(b"a")
    assert c.get(b"c") == "C" and c.tier_of(b"c") == 1 and c.tier_of(b"a") == 2


def test_tiered_replace_moves_key_and_stays_exclusive():
    c = tiered(1, 2)
    c.put(b"a", "A", 1)
    c.put(b"b", "B", 1)
    assert c.tier_of(b"a") == 2
    c.put(b"a", "A2", 1)
    assert c.tier_of(b"a") == 1 and c.tier_of(b"b") == 2 and len(c) == 2
    assert c.get(b"a") == "A2" and c.current_bytes == 2
    assert c.discard(b"b") and c.tier_of(b"b") is None


class TieredMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = tiered(6, 9)
        self.values, self.pins = {}, Counter()
        self.must_stay = {}  # key -> tier it was pinned in; the key must not leave it

    def forget(self, k):
        self.must_stay.pop(k, None)

    @rule(k=st.sampled_from(KEYS), n=st.integers(0, 10), v=st.integers())
    def put(self, k, n, v):
        self.forget(k)
        stored = self.cache.put(k, v, n)
        assert stored == (k in self.cache)
        self.values[k] = v

    @rule(k=st.sampled_from(KEYS), pin=st.booleans())
    def lookup(self, k, pin):
        present = k in self.cache
        got = self.cache.acquire(k) if pin else self.cache.get(k)
        assert got == (self.values[k] if present else None)
        if present and pin:
            self.pins[k] += 1
            self.must_stay.setdefault(k, self.cache.tier_of(k))

    @rule(k=st.sampled_from(KEYS))
    def release(self, k):
        if self.pins[k]:
            self.cache.release(k)
            self.pins[k] -= 1
            if not self.pins[k]:
                self.forget(k)
        else:
            with pytest.raises(PinError):
                self.cache.release(k)

    @rule(k=st.sampled_from(KEYS))
    def discard(self, k):
        self.forget(k)
        self.cache.discard(k)
        assert k not in self.cache

    @invariant()
    def tiers_exclusive_bounded_and_tagged(self):
        l1, l2 = self.cache._l1.entries, self.cache._l2.entries
        assert not set(l1) & set(l2)
        assert sum(n for _, n in l1.values()) == self.cache.stats.l1.current_bytes <= 6
        assert sum(n for _, n in l2.values()) == self.cache.stats.l2.current_bytes <= 9
        assert all(v == self.values[k] for k, (v, _) in l1.items())
        assert all(v == ("host", self.values[k]) for k, (v, _) in l2.items())

    @invariant()
    def pinned_keys_stay_put(self):
        for k, level in self.must_stay.items():
            # A pinned L2 key may still be promoted; a pinned L1 key never moves.
            assert self.cache.tier_of(k) in ((1,) if level == 1 else (1, 2))


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
