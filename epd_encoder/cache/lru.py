# SPDX-License-Identifier: Apache-2.0
"""The embedding cache: a bytes-bounded LRU, single-tier or device/host tiered.

Keys are content keys (32-byte blake3 digests, treated as opaque hashables).
A value is an item's full output (``ItemOutput``: embedding plus deepstack);
the cache never looks inside it and accounts the ``nbytes`` it is given.

Contract shared by :class:`EmbeddingCache` and :class:`TieredEmbeddingCache`:

* ``current_bytes <= capacity`` holds per tier after every call, and equals
  the sum of the stored entries' ``nbytes``. An entry bigger than a tier's
  capacity is never stored in that tier.
* ``put`` returns whether the value was stored. It replaces an existing key
  (old bytes out, new bytes in). A replaced key that cannot be stored again
  is left absent, so a stale value is never served.
* Pins are reference counts per key. ``acquire`` is a lookup that pins;
  ``pin`` pins a present key without counting a lookup. A pinned entry is
  never evicted or demoted. A ``put`` that could only make room by evicting
  pinned entries is refused (counted in ``rejected``).
* ``discard``, ``clear`` and replacing ``put`` remove entries even if pinned:
  the holder keeps the value object it was given, the bytes leave the
  accounting at once, and the pin count stays with the key until released
  (a key re-stored while still pinned is pinned). ``release`` beyond the
  pins taken raises :class:`PinError`.
* ``get``/``acquire`` count hits and misses and feed the admission policy;
  ``in``, ``pin``, ``put`` and ``stats`` do neither and do not touch LRU order.
* All methods are thread-safe (one lock per cache) and O(1) amortised, plus
  O(pinned) to skip pinned entries while choosing victims.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from epd_encoder.cache.admission import AdmissionPolicy, make_admission

__all__ = [
    "CacheStats",
    "EmbeddingCache",
    "InTransit",
    "PinError",
    "PinnedStats",
    "TieredCacheStats",
]


class PinError(RuntimeError):
    """``release`` was called for a key with no outstanding pin."""


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of counters.

    Each entry leaving a tier is counted once, on that tier, by route:
    ``evictions`` (out of the cache to make room), ``demotions`` (down to
    L2) or ``promotions`` (up to L1). ``rejected`` counts offers refused.
    """

    hits: int
    misses: int
    evictions: int
    rejected: int
    current_bytes: int
    capacity_bytes: int
    entries: int
    pinned: int = 0  # keys with outstanding pins, stored or not
    demotions: int = 0
    promotions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(frozen=True)
class TieredCacheStats(CacheStats):
    """Whole-cache totals plus the per-tier snapshots ``l1`` and ``l2``.

    ``hits`` sums both tiers, ``misses`` are lookups found in neither, and
    ``rejected`` counts puts stored in neither tier.
    """

    l1: CacheStats | None = None
    l2: CacheStats | None = None


@dataclass(frozen=True)
class PinnedStats:
    """What in-flight deliveries hold: keys with outstanding pins (stored or not),
    and the bytes of those still stored. Both are 0 whenever nothing is in flight."""

    entries: int
    bytes: int


class InTransit:
    """A tier's placeholder for an entry whose copy between tiers runs outside the lock:
    ``source`` is the value being copied, ``done`` is set once the copy has ended. Its
    bytes count in the destination tier from the start; it is never chosen as a victim."""

    __slots__ = ("source", "done")

    def __init__(self, source: Any) -> None:
        self.source, self.done = source, threading.Event()


class _Tier:
    """One bytes-bounded LRU store; unlocked, the owning cache holds the lock."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity = capacity
        self.used = 0
        self.entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.hits = self.misses = self.evictions = self.rejected = 0
        self.demotions = self.promotions = 0

    def victims(self, nbytes: int, pins: dict) -> list | None:
        """Oldest unpinned keys not in transit whose removal fits ``nbytes``; None if impossible."""
        need = self.used + nbytes - self.capacity
        if need <= 0:
            return []
        out, freed = [], 0
        for key, (value, n) in self.entries.items():
            if n == 0 or key in pins or isinstance(value, InTransit):
                continue
            out.append(key)
            freed += n
            if freed >= need:
                return out
        return None

    def insert(self, key: Hashable, value: Any, nbytes: int) -> None:
        self.entries[key] = (value, nbytes)
        self.used += nbytes

    def pop(self, key: Hashable) -> tuple[Any, int]:
        value, nbytes = self.entries.pop(key)
        self.used -= nbytes
        return value, nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.used = 0

    def snapshot(self, pinned: int) -> CacheStats:
        counters = ("hits", "misses", "evictions", "rejected", "demotions", "promotions")
        return CacheStats(
            **{name: getattr(self, name) for name in counters},
            current_bytes=self.used,
            capacity_bytes=self.capacity,
            entries=len(self.entries),
            pinned=pinned,
        )


def _check_nbytes(nbytes: int) -> int:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return int(nbytes)



class _BaseCache:
    """Lock, tiers, pin table and admission plumbing shared by both caches."""

    def __init__(
        self,
        tiers: tuple[_Tier, ...],
        admission: "str | AdmissionPolicy | None",
        expected_entries: int,
    ) -> None:
        self._lock = threading.Lock()
        self._tiers = tiers
        self._pins: dict[Hashable, int] = {}
        self._admission = make_admission(admission, expected_entries)

    @property
    def admission(self) -> AdmissionPolicy:
        return self._admission

    def _plan(self, tier: _Tier, key: Hashable, nbytes: int, bypass: bool) -> list | None:
        """Victims to evict from ``tier`` to store ``key``, or None if refused."""
        if nbytes > tier.capacity:
            return None
        victims = tier.victims(nbytes, self._pins)
        if victims and not bypass and not self._admission.admit(key, victims):
            return None
        return victims

    @staticmethod
    def _evict(tier: _Tier, victims: list) -> None:
        for victim in victims:
            tier.pop(victim)
        tier.evictions += len(victims)

    def _remove(self, key: Hashable) -> bool:
        for tier in self._tiers:
            if key in tier.entries:
                tier.pop(key)
                return True
        return False

    def _has(self, key: object) -> bool:
        return any(key in tier.entries for tier in self._tiers)

    def _lookup(self, key: Hashable) -> Any | None:
        raise NotImplementedError

    def get(self, key: Hashable) -> Any | None:
        """The value for ``key`` (marked most recently used), or None."""
        with self._lock:
            return self._lookup(key)

    def acquire(self, key: Hashable) -> Any | None:
        """A ``get`` that also pins the entry when found."""
        with self._lock:
            value = self._lookup(key)
            if value is not None:
                self._pins[key] = self._pins.get(key, 0) + 1
            return value

    def pin(self, key: Hashable) -> bool:
        """Pin ``key`` if present, without counting a lookup; whether it was."""
        with self._lock:
            if not self._has(key):
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def release(self, key: Hashable) -> None:
        """Drop one pin taken by ``acquire`` or ``pin``."""
        with self._lock:
            count = self._pins.get(key, 0)
            if count == 0:
                raise PinError(f"release of key {key!r} without a matching acquire")
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    def pin_count(self, key: Hashable) -> int:
        with self._lock:
            return self._pins.get(key, 0)

    def pinned_stats(self) -> PinnedStats:
        """A consistent snapshot of the pins, read under the lock in O(pinned)."""
        with self._lock:
            stored = 0
            for key in self._pins:
                for tier in self._tiers:
                    entry = tier.entries.get(key)
                    if entry is not None:
                        stored += entry[1]
                        break
            return PinnedStats(entries=len(self._pins), bytes=stored)

    def discard(self, key: Hashable) -> bool:
        """Remove ``key`` (even if pinned); whether it was present."""
        with self._lock:
            return self._remove(key)

    def clear(self) -> None:
        """Remove every entry; counters and outstanding pins are kept."""
        with self._lock:
            for tier in self._tiers:
                tier.clear()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return self._has(key)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(tier.entries) for tier in self._tiers)

    @property
    def current_bytes(self) -> int:
        with self._lock:
            return sum(tier.used for tier in self._tiers)

    @property
    def capacity_bytes(self) -> int:
        return sum(tier.capacity for tier in self._tiers)


class EmbeddingCache(_BaseCache):
    """A bytes-bounded LRU of item outputs (see the module docstring).

    ``admission`` is ``None``/``"lru"`` (plain LRU), ``"tinylfu"`` (a
    :class:`~epd_encoder.cache.admission.TinyLFU` sized by
    ``expected_entries``) or any ``AdmissionPolicy``. Admission is asked only
    when a new key needs evictions; replacing a stored key bypasses it.
    """

    def __init__(
        self,
        capacity_bytes: int,
        admission: "str | AdmissionPolicy | None" = None,
        *,
        expected_entries: int = 4096,
    ) -> None:
        self._tier = _Tier(capacity_bytes)
        super().__init__((self._tier,), admission, expected_entries)

    def _lookup(self, key: Hashable) -> Any | None:
        self._admission.record(key)
        tier = self._tier
        entry = tier.entries.get(key)
        if entry is None:
            tier.misses += 1
            return None
        tier.entries.move_to_end(key)
        tier.hits += 1
        return entry[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> bool:
        """Store ``value`` under ``key``; whether it was stored."""
        nbytes = _check_nbytes(nbytes)
        with self._lock:
            tier = self._tier
            replacing = self._remove(key)
            victims = self._plan(tier, key, nbytes, bypass=replacing)
            if victims is None:
                tier.rejected += 1
                return False
            self._evict(tier, victims)
            tier.insert(key, value, nbytes)
            return True

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return self._tier.snapshot(len(self._pins))
