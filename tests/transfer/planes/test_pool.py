# SPDX-License-Identifier: Apache-2.0
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_encoder.errors import Overloaded
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.planes.pool import BufferPool, _class_of, _search_class

CAP = 64 * 256


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def check_invariants(pool: BufferPool, live: dict[int, Region], quarantined: list[tuple[int, int]]) -> None:
    spans = sorted([(r.offset, -(-r.nbytes // 64) * 64) for r in live.values()] + quarantined
                   + pool.free_blocks())
    pos = 0
    for off, n in spans:  # live, quarantined and free blocks tile [0, capacity) exactly
        assert off == pos and n > 0 and off % 64 == 0
        pos += n
    assert pos == pool.capacity
    free = pool.free_blocks()
    for (a, an), (b, _) in zip(free, free[1:]):
        assert a + an < b, "adjacent free blocks were not coalesced"


ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, CAP + 100)),
    st.tuples(st.just("free"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("tick"), st.floats(0, 3)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_alloc_free_keeps_the_pool_consistent(seq):
    clock = Clock()
    pool = BufferPool(CAP, quarantine_s=2.0, clock=clock)
    live: dict[int, Region] = {}
    quarantine: list[tuple[float, int, int]] = []
    for op in seq:
        quarantine = [q for q in quarantine if q[0] > clock.t]
        if op[0] == "alloc":
            n = op[1]
            fits = any(size >= -(-n // 64) * 64 for _, size in pool.free_blocks()) or n == 0
            try:
                r = pool.allocate(n)
            except Overloaded:
                assert not fits, f"{n} B refused although a big enough free block exists"
                continue
            assert fits and r.nbytes == n
            if n:
                assert r.offset + n <= CAP
                for _, qo, qn in quarantine:  # never hand out a quarantined byte
                    assert r.offset + n <= qo or qo + qn <= r.offset
                live[r.offset] = r
        elif op[0] == "free" and live:
            r = live.pop(sorted(live)[op[1] % len(live)])
            pool.free(r, failed=op[2])
            if op[2]:
                quarantine.append((clock.t + 2.0, r.offset, -(-r.nbytes // 64) * 64))
        elif op[0] == "tick":
            clock.t += op[1]
            pool.reclaim()
        quarantine = [q for q in quarantine if q[0] > clock.t]
        check_invariants(pool, live, [(o, n) for _, o, n in quarantine])
    for r in live.values():
        pool.free(r)
    clock.t += 10
    pool.reclaim()
    assert pool.free_blocks() == [(0, CAP)] and pool.used_bytes == 0 and pool.quarantined_bytes == 0


def test_coalescing_restores_one_block_in_any_free_order():
    pool = BufferPool(64 * 10)
    regions = [pool.allocate(64) for _ in range(10)]
    with pytest.raises(Overloaded):
        pool.allocate(1)
    for i in (3, 5, 4, 0, 9, 1, 2, 8, 6, 7):
        pool.free(regions[i])
    assert pool.free_blocks() == [(0, 640)]
    assert pool.allocate(640).offset == 0


def test_quarantine_holds_a_failed_region_until_its_window_passes():
    clock = Clock()
    pool = BufferPool(128, quarantine_s=5.0, clock=clock)
    r = pool.allocate(128)
    pool.free(r, failed=True)
    assert pool.quarantined_bytes == 128 and pool.free_bytes == 0
    with pytest.raises(Overloaded, match="quarantined"):
        pool.allocate(64)
    clock.t = 4.9
    with pytest.raises(Overloaded):
        pool.allocate(64)
    clock.t = 5.0
    assert pool.allocate(128).offset == 0


def test_a_clean_free_is_reusable_at_once_and_alignment_is_64():
    pool = BufferPool(1000, quarantine_s=5.0)
    assert pool.capacity == 960
    a, b = pool.allocate(1), pool.allocate(65)
    assert (a.offset, b.offset) == (0, 64) and b.nbytes == 65
    pool.free(a)
    assert pool.allocate(64).offset == 0


def test_zero_bytes_double_free_and_foreign_regions():
    pool = BufferPool(256)
    z = pool.allocate(0)
    assert z.nbytes == 0
    pool.free(z)  # owns nothing, frees nothing
    r = pool.allocate(10)
    pool.free(r)
    with pytest.raises(ValueError):
        pool.free(r)
    with pytest.raises(ValueError):
        pool.free(Region(32, 10))
    with pytest.raises(ValueError):
        pool.allocate(-1)


def class_floor(c: int) -> int:
    """The smallest block size (in units) of class ``c``."""
    return c if c < 8 else (8 | c % 8) << (c // 8 - 1)


@given(st.integers(1, 1 << 40))
def test_size_classes_are_monotone_and_the_search_class_only_holds_blocks_that_fit(units):
    c = _class_of(units)
    assert class_floor(c) <= units and _class_of(class_floor(c)) == c
    assert class_floor(c) == 1 or _class_of(class_floor(c) - 1) == c - 1
    s = _search_class(units)
    assert s in (c, c + 1) and class_floor(s) >= units
