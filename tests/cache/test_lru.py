# SPDX-License-Identifier: Apache-2.0
import random
import threading
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from epd_encoder.cache.lru import CacheStats, EmbeddingCache, PinError

KEYS = [bytes([i]) * 32 for i in range(8)]


class RejectAll:
    def record(self, key):
        pass

    def admit(self, candidate, victims):
        return False


def test_get_put_len_bytes_and_stats():
    c = EmbeddingCache(capacity_bytes=100)
    assert c.get(b"a") is None
    assert c.put(b"a", "A", 30) and c.put(b"b", "B", 20)
    assert c.get(b"a") == "A"
    assert len(c) == 2 and c.current_bytes == 50 and c.capacity_bytes == 100
    s = c.stats
    assert isinstance(s, CacheStats)
    assert (s.hits, s.misses, s.evictions, s.rejected, s.entries) == (1, 1, 0, 0, 2)
    assert s.current_bytes == 50 and s.capacity_bytes == 100 and s.hit_rate == 0.5


def test_oversize_entry_not_stored_and_nothing_evicted():
    c = EmbeddingCache(capacity_bytes=10)
    c.put(b"a", "A", 5)
    assert c.put(b"big", "X", 11) is False
    assert b"big" not in c and b"a" in c and c.current_bytes == 5
    assert c.stats.rejected == 1 and c.stats.evictions == 0
    assert c.put(b"exact", "E", 10) and c.current_bytes == 10 and b"a" not in c


def test_lru_order_get_refreshes():
    c = EmbeddingCache(capacity_bytes=3)
    for k in (b"a", b"b", b"c"):
        c.put(k, k, 1)
    c.get(b"a")
    c.put(b"d", b"d", 1)
    assert b"b" not in c and {b"a", b"c", b"d"} <= {k for k in (b"a", b"c", b"d") if k in c}
    c.put(b"e", b"e", 2)  # needs two victims: c then a
    assert b"c" not in c and b"a" not in c and b"d" in c and b"e" in c
    assert c.stats.evictions == 3


def test_contains_touches_neither_lru_nor_stats():
    c = EmbeddingCache(capacity_bytes=2)
    c.put(b"a", 1, 1)
    c.put(b"b", 2, 1)
    assert b"a" in c and b"zz" not in c
    c.put(b"c", 3, 1)
    assert b"a" not in c
    assert c.stats.hits == 0 and c.stats.misses == 0


def test_replace_keeps_exact_accounting():
    c = EmbeddingCache(capacity_bytes=10)
    c.put(b"a", "A1", 4)
    c.put(b"b", "B", 3)
    assert c.put(b"a", "A2", 6)
    assert c.get(b"a") == "A2" and c.current_bytes == 9 and len(c) == 2
    assert c.put(b"a", "A3", 9)  # evicts b to fit the larger value
    assert c.current_bytes == 9 and b"b" not in c


def test_failed_replace_leaves_key_absent():
    c = EmbeddingCache(capacity_bytes=10)
    c.put(b"a", "A1", 4)
    assert c.put(b"a", "A2", 11) is False
    assert b"a" not in c and c.current_bytes == 0


def test_replace_bypasses_admission_but_new_keys_do_not():
    c = EmbeddingCache(capacity_bytes=2, admission=RejectAll())
    assert c.put(b"a", 1, 1) and c.put(b"b", 2, 1)  # fits: admission not asked
    assert c.put(b"c", 3, 1) is False and c.stats.rejected == 1
    assert c.put(b"a", 10, 2) and c.get(b"a") == 10 and b"b" not in c


def test_zero_and_negative_nbytes():
    c = EmbeddingCache(capacity_bytes=1)
    c.put(b"z", "Z", 0)
    c.put(b"a", "A", 1)
    c.put(b"b", "B", 1)  # zero-size entries are never chosen as victims
    assert b"z" in c and b"a" not in c
    with pytest.raises(ValueError):
        c.put(b"n", "N", -1)
    with pytest.raises(ValueError):
        EmbeddingCache(capacity_bytes=-1)


def test_discard_and_clear():
    c = EmbeddingCache(capacity_bytes=10)
    c.put(b"a", "A", 4)
    c.put(b"b", "B", 4)
    assert c.discard(b"a") and not c.discard(b"a")
    assert c.current_bytes == 4 and len(c) == 1
    c.clear()
    assert len(c) == 0 and c.current_bytes == 0 and c.get(b"b") is None


def test_admission_specs():
    assert EmbeddingCache(1, admission="lru").put(b"a", 1, 1)
    EmbeddingCache(1, admission="tinylfu")
    with pytest.raises(ValueError):
        EmbeddingCache(1, admission="arc")
    with pytest.raises(TypeError):
        EmbeddingCache(1, admission=42)


# --- pinning ------------------------------------------------------------------


def test_pinned_entry_survives_puts_and_release_lets_it_go():
    c = EmbeddingCache(capacity_bytes=3)
    c.put(b"p", "P", 1)
    assert c.acquire(b"p") == "P" and c.stats.hits == 1 and c.stats.pinned == 1
    for i in range(20):
        c.put(bytes([i]), i, 1)
        assert b"p" in c and c.current_bytes <= 3
    c.release(b"p")
    c.put(b"x", 0, 1)
    c.put(b"y", 0, 1)
    assert b"p" not in c


def test_put_rejected_when_only_pinned_entries_could_make_room():
    c = EmbeddingCache(capacity_bytes=4)
    c.put(b"a", "A", 2)
    c.put(b"b", "B", 2)
    assert c.pin(b"a") and c.pin(b"b") and not c.pin(b"missing")
    assert c.put(b"c", "C", 1) is False
    assert c.stats.rejected == 1 and c.current_bytes == 4 and b"a" in c and b"b" in c
    c.release(b"b")
    assert c.put(b"c", "C", 1) and b"b" not in c and b"a" in c


def test_release_errors_and_refcount():
    c = EmbeddingCache(capacity_bytes=4)
    with pytest.raises(PinError):
        c.release(b"a")
    c.put(b"a", "A", 1)
    c.acquire(b"a")
    c.acquire(b"a")
    assert c.pin_count(b"a") == 2
    c.release(b"a")
    c.release(b"a")
    with pytest.raises(PinError):
        c.release(b"a")
    assert c.acquire(b"missing") is None and c.pin_count(b"missing") == 0


def test_discarded_pinned_entry_stays_with_holder_and_pin_follows_key():
    c = EmbeddingCache(capacity_bytes=2)
    c.put(b"a", ["A"], 1)
    held = c.acquire(b"a")
    assert c.discard(b"a") and c.current_bytes == 0 and held == ["A"]
    c.put(b"a", ["A2"], 1)  # re-stored while the old holder still has a pin
    c.put(b"b", 0, 1)
    assert c.put(b"c", 0, 1) and b"a" in c and b"b" not in c
    c.release(b"a")
    with pytest.raises(PinError):
        c.release(b"a")


def test_threads_keep_accounting_exact():
    c = EmbeddingCache(capacity_bytes=50, admission="tinylfu", expected_entries=16)

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(1500):
            k = bytes([rng.randrange(40)])
            op = rng.random()
            if op < 0.4:
                c.put(k, k, rng.randrange(1, 9))
            elif op < 0.8:
                if c.acquire(k) is not None:
                    c.release(k)
            else:
                c.get(k)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries = c._tier.entries
    assert c.current_bytes == sum(n for _, n in entries.values()) <= 50
    assert c.stats.pinned == 0 and c.stats.entries == len(entries)


class ReferenceLRU:
    """A list-based executable spec of the single-tier contract."""

    def __init__(self, capacity):
        self.capacity, self.order, self.size, self.pins = capacity, [], {}, Counter()

    def touch(self, k):
        self.order.remove(k)
        self.order.append(k)

    def remove(self, k):
        self.order.remove(k)
        del self.size[k]

    def put(self, k, n):
        if k in self.size:
            self.remove(k)
        if n > self.capacity:
            return False
        need = sum(self.size.values()) + n - self.capacity
        victims = []
        for v in self.order:
            if need <= 0:
                break
            if self.size[v] and not self.pins[v]:
                victims.append(v)
                need -= self.size[v]
        if need > 0:
            return False
        for v in victims:
            self.remove(v)
        self.order.append(k)
        self.size[k] = n
        return True


class LRUMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = EmbeddingCache(capacity_bytes=10)
        self.ref = ReferenceLRU(10)
        self.values, self.hits, self.misses = {}, 0, 0

    @rule(k=st.sampled_from(KEYS), n=st.integers(0, 12), v=st.integers())
    def put(self, k, n, v):
        assert self.cache.put(k, v, n) == self.ref.put(k, n)
        self.values[k] = v

    @rule(k=st.sampled_from(KEYS), pin=st.booleans())
    def lookup(self, k, pin):
        got = self.cache.acquire(k) if pin else self.cache.get(k)
        if k in self.ref.size:
            assert got == self.values[k]
            self.ref.touch(k)
            self.hits += 1
            self.ref.pins[k] += pin
        else:
            assert got is None
            self.misses += 1

    @rule(k=st.sampled_from(KEYS))
    def release(self, k):
        if self.ref.pins[k]:
            self.cache.release(k)
            self.ref.pins[k] -= 1
        else:
            with pytest.raises(PinError):
                self.cache.release(k)

    @rule(k=st.sampled_from(KEYS))
    def discard(self, k):
        assert self.cache.discard(k) == (k in self.ref.size)
        if k in self.ref.size:
            self.ref.remove(k)

    @precondition(lambda self: len(self.ref.size) > 3)
    @rule()
    def clear(self):
        self.cache.clear()
        self.ref.order, self.ref.size = [], {}

    @invariant()
    def matches_reference(self):
        assert [k for k in KEYS if k in self.cache] == [k for k in KEYS if k in self.ref.size]
        assert list(self.cache._tier.entries) == self.ref.order
        assert self.cache.current_bytes == sum(self.ref.size.values()) <= 10
        s = self.cache.stats
        assert (s.hits, s.misses, s.entries) == (self.hits, self.misses, len(self.ref.size))
        assert s.pinned == sum(1 for c in self.ref.pins.values() if c)


TestLRUMachine = LRUMachine.TestCase
TestLRUMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
