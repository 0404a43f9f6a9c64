# SPDX-License-Identifier: Apache-2.0
"""Admission policies for the embedding cache.

A plain LRU lets one pass over many unique images (a crawl, a batch job)
flush every hot embedding. An admission policy sits in front of eviction:
when storing a candidate would evict entries, the cache asks the policy
whether the candidate is worth more than what it would displace.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["AdmissionPolicy", "AdmitAll", "TinyLFU", "make_admission"]


@runtime_checkable
class AdmissionPolicy(Protocol):
    """What the cache asks before it evicts to make room.

    The cache calls both methods under its own lock, so implementations need
    no locking of their own; a policy object must not be shared by two caches.
    """

    def record(self, key: Hashable) -> None:
        """Note one lookup of ``key`` (a hit or a miss; stores do not count)."""

    def admit(self, candidate: Hashable, victims: Sequence[Hashable]) -> bool:
        """Whether ``candidate`` may be stored at the cost of evicting ``victims``.

        Only asked when ``victims`` is non-empty (in LRU order, oldest first);
        a candidate that fits without eviction is always stored.
        """


class AdmitAll:
    """Plain LRU: every candidate is admitted."""

    def record(self, key: Hashable) -> None:
        pass

    def admit(self, candidate: Hashable, victims: Sequence[Hashable]) -> bool:
        return True


def _key_bytes(key: Hashable) -> bytes:
    # Python's hash() of bytes/str is salted per process; hashing a stable
    # encoding keeps the policy deterministic across runs and TP ranks.
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, str):
        return key.encode()
    return repr(key).encode()


_HALVE = bytes(i >> 1 for i in range(256))
_WORDS = struct.Struct("<8I")


class TinyLFU:
    """TinyLFU: a count-min sketch of recent lookup frequency, plus a doorkeeper.

    ``admit`` is true when the candidate's estimated frequency is strictly
    greater than that of every victim. Counters saturate at 15 (4-bit
    semantics, one byte each) and all halve every ``sample_size`` lookups, so
    the estimate follows the recent past. The doorkeeper is a Bloom filter
    that absorbs each key's first lookup in a period, keeping one-off keys
    out of the sketch; it is cleared at each halving.

    ``expected_entries`` is roughly how many entries the cache holds; it sizes
    the sketch (width the next power of two >= 2x that) and, by default,
    ``sample_size`` (10x that). Hashing is blake2b keyed by ``seed``.
    """

    DEPTH = 4  # rows of the sketch; the hashing below is unrolled for 4
    MAX_COUNT = 15

    def __init__(
        self,
        expected_entries: int = 4096,
        *,
        sample_size: int | None = None,
        doorkeeper: bool = True,
        seed: int = 0,
    ) -> None:
        if expected_entries < 1:
            raise ValueError("expected_entries must be >= 1")
        width = 16
        while width < 2 * expected_entries:
            width <<= 1
        self._width = width
        self._mask = width - 1
        self._table = bytearray(self.DEPTH * width)
        self.sample_size = sample_size if sample_size is not None else 10 * expected_entries
        if self.sample_size < 1:
            raise ValueError("sample_size must be >= 1")
        bits = 64
        while doorkeeper and bits < 8 * self.sample_size:
            bits <<= 1
        self._door_mask = bits - 1
        self._door = bytearray(bits // 8)
        self._use_door = doorkeeper
        self._salt = seed.to_bytes(8, "little", signed=True)
        self._lookups = 0
        self.resets = 0
        # Hot keys are hashed on every lookup and admission test; a bounded memo
        # of their slots (cleared wholesale when full) skips the digest.
        self._memo: dict[Hashable, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._memo_cap = 4 * width

    def _slots(self, key: Hashable) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The key's 4 sketch cells and its 3 doorkeeper (byte, bit) pairs."""
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        w = _WORDS.unpack(hashlib.blake2b(_key_bytes(key), key=self._salt, digest_size=32).digest())
        mask, width, dm = self._mask, self._width, self._door_mask
        rows = (w[0] & mask, width + (w[1] & mask), 2 * width + (w[2] & mask), 3 * width + (w[3] & mask))
        x, y, z = w[4] & dm, w[5] & dm, w[6] & dm
        door = (x >> 3, 1 << (x & 7), y >> 3, 1 << (y & 7), z >> 3, 1 << (z & 7))
        if len(self._memo) >= self._memo_cap:
            self._memo.clear()
        self._memo[key] = hit = (rows, door)
        return hit

    def _seen(self, door: tuple[int, ...]) -> bool:
        d = self._door
        i0, m0, i1, m1, i2, m2 = door
        return bool(d[i0] & m0 and d[i1] & m1 and d[i2] & m2)

    def frequency(self, key: Hashable) -> int:
        """The estimated number of lookups of ``key`` in the recent past."""
        (a, b, c, d), door = self._slots(key)
        t = self._table
        est = min(t[a], t[b], t[c], t[d])
        return est + 1 if self._use_door and self._seen(door) else est

    def record(self, key: Hashable) -> None:
        rows, door = self._slots(key)
        if self._use_door and not self._seen(door):
            i0, m0, i1, m1, i2, m2 = door
            d = self._door
            d[i0] |= m0
            d[i1] |= m1
            d[i2] |= m2
        else:
            t = self._table
            a, b, c, d = rows
            low = min(t[a], t[b], t[c], t[d])
            if low < self.MAX_COUNT:
                # Conservative update: raise only the counters at the minimum.
                for i in rows:
                    if t[i] == low:
                        t[i] = low + 1
        self._lookups += 1
        if self._lookups >= self.sample_size:
            self._age()

    def _age(self) -> None:
        self._table = self._table.translate(_HALVE)
        self._door = bytearray(len(self._door))
        self._lookups = 0
        self.resets += 1

    def admit(self, candidate: Hashable, victims: Sequence[Hashable]) -> bool:
        freq = self.frequency(candidate)
        return all(freq > self.frequency(v) for v in victims)


def make_admission(
    spec: "str | AdmissionPolicy | None", expected_entries: int = 4096
) -> AdmissionPolicy:
    """``None`` or ``"lru"`` -> :class:`AdmitAll`; ``"tinylfu"`` -> :class:`TinyLFU`;
    a policy object is returned as is."""
    if spec is None or spec == "lru":
        return AdmitAll()
    if spec == "tinylfu":
        return TinyLFU(expected_entries)
    if isinstance(spec, str):
        raise ValueError(f"unknown admission policy {spec!r}; expected 'lru' or 'tinylfu'")
    if not isinstance(spec, AdmissionPolicy):
        raise TypeError(f"admission must be 'lru', 'tinylfu' or an AdmissionPolicy, got {spec!r}")
    return spec
