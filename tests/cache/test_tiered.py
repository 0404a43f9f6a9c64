# SPDX-License-Identifier: Apache-2.0
import threading
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from epd_encoder.cache.lru import PinError, TieredCacheStats
from epd_encoder.cache.tiered import TieredEmbeddingCache

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


# --- copies outside the lock --------------------------------------------------------


class SlowCopy:
    """Copies that stop at ``started`` for the values in ``slow`` until ``proceed`` is set."""

    def __init__(self, copy, *slow, error: BaseException | None = None):
        self.copy, self.slow, self.error = copy, set(slow), error
        self.started, self.proceed = threading.Event(), threading.Event()

    def __call__(self, value):
        if value in self.slow:
            self.started.set()
            assert self.proceed.wait(10)
            if self.error is not None:
                raise self.error
        return self.copy(value)


def in_thread(fn):
    """Run ``fn`` on a thread; returns (thread, box) where box[0] is its result or error."""
    box = []

    def run():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def waiting_on(entry) -> threading.Event:
    """Set once a lookup blocks on ``entry``'s in-transit marker (its ``done.wait``)."""
    marker, waiting = entry[0], threading.Event()
    wait = marker.done.wait
    marker.done.wait = lambda timeout=None: (waiting.set(), wait(timeout))[1]
    return waiting


def lock_is_free(c) -> bool:
    if not c._lock.acquire(blocking=False):
        return False
    c._lock.release()
    return True


def test_a_demotion_copies_outside_the_lock_and_the_entry_stays_served_meanwhile():
    slow = SlowCopy(to_host, "A")
    c = TieredEmbeddingCache(l1_capacity_bytes=2, l2_capacity_bytes=4, to_host=slow, to_device=to_device)
    c.put(b"a", "A", 1)
    c.put(b"b", "B", 1)
    t, box = in_thread(lambda: c.put(b"c", "C", 1))  # demotes a, through the slow copy
    assert slow.started.wait(10)
    assert lock_is_free(c)  # the event loop's pin/release never waits for a copy
    assert c.pin(b"a") and b"a" in c and c.tier_of(b"a") == 2  # in transit: already where it goes
    assert c.get(b"a") == "A"  # the device value, still good until the host copy lands
    assert c.stats.l1.current_bytes == 2 and c.stats.l2.current_bytes == 1
    c.release(b"a")
    slow.proceed.set()
    t.join(10)
    assert box == [True] and c._l2.entries[b"a"][0] == ("host", "A")
    assert c.get(b"a") == "A" and c.pin_count(b"a") == 0


def test_a_lookup_of_a_promoting_entry_waits_for_the_copy_and_a_pin_is_never_lost():
    slow = SlowCopy(to_device, ("host", "A"))
    c = TieredEmbeddingCache(l1_capacity_bytes=1, l2_capacity_bytes=2, to_host=to_host, to_device=slow)
    c.put(b"a", "A", 1)
    c.put(b"b", "B", 1)  # a is demoted to L2
    first, got = in_thread(lambda: c.acquire(b"a"))  # promotes a, demotes b
    assert slow.started.wait(10)
    assert lock_is_free(c)
    assert c.pin(b"a") and c.tier_of(b"a") == 1 and c.tier_of(b"b") == 2
    waiting = waiting_on(c._l1.entries[b"a"])
    second, also = in_thread(lambda: c.get(b"a"))  # must not see the host value
    assert waiting.wait(10)  # the lookup is blocked on the copy
    slow.proceed.set()
    first.join(10), second.join(10)
    assert got == ["A"] and also == ["A"]  # never half an entry: the device value, once copied
    assert c._l1.entries[b"a"][0] == "A" and c.pin_count(b"a") == 2
    c.release(b"a"), c.release(b"a")
    s = c.stats
    assert (s.l2.promotions, s.l1.current_bytes, s.l2.current_bytes, s.pinned) == (1, 1, 1, 0)


def test_a_failed_promotion_drops_the_entry_and_its_waiters_miss():
    slow = SlowCopy(to_device, ("host", "A"), error=RuntimeError("device out of memory"))
    c = TieredEmbeddingCache(l1_capacity_bytes=1, l2_capacity_bytes=2, to_host=to_host, to_device=slow)
    c.put(b"a", "A", 1)
    c.put(b"b", "B", 1)
    first, got = in_thread(lambda: c.acquire(b"a"))
    assert slow.started.wait(10)
    waiting = waiting_on(c._l1.entries[b"a"])
    second, also = in_thread(lambda: c.get(b"a"))
    assert waiting.wait(10)  # the lookup is blocked on the copy
    slow.proceed.set()
    first.join(10), second.join(10)
    assert isinstance(got[0], RuntimeError) and also == [None]
    assert b"a" not in c and c.pin_count(b"a") == 0 and c.stats.l1.current_bytes == 0


def test_an_entry_replaced_during_its_copy_keeps_the_new_value():
    slow = SlowCopy(to_host, "A")
    c = TieredEmbeddingCache(l1_capacity_bytes=2, l2_capacity_bytes=4, to_host=slow, to_device=to_device)
    c.put(b"a", "A", 1)
    c.put(b"b", "B", 1)
    t, box = in_thread(lambda: c.put(b"c", "C", 1))
    assert slow.started.wait(10)
    assert c.put(b"a", "A2", 1)  # the old value is on its way to L2; this one wins
    slow.proceed.set()
    t.join(10)
    assert box == [True] and c.get(b"a") == "A2" and c.tier_of(b"a") == 1
    assert not set(c._l1.entries) & set(c._l2.entries)
    assert sum(n for _, n in c._l2.entries.values()) == c.stats.l2.current_bytes
