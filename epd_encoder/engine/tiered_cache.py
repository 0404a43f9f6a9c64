# SPDX-License-Identifier: Apache-2.0
"""The two-tier cache: L1 on the encode device, L2 in host memory, exclusive.

It keeps the contract documented in ``epd_encoder.engine.cache``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from epd_encoder.engine.admission import AdmissionPolicy
from epd_encoder.engine.cache import (
    TieredCacheStats,
    _BaseCache,
    _check_nbytes,
    _Tier,
)

__all__ = ["TieredEmbeddingCache"]


def _identity(value: Any) -> Any:
    return value


class TieredEmbeddingCache(_BaseCache):
    """Two exclusive bytes-bounded LRU tiers: L1 on the encode device, L2 in host memory.

    A key lives in at most one tier. ``put`` stores into L1; L1 victims are
    demoted to L2 through ``to_host``. A value L1 refuses (too big, pinned
    full, or not admitted) is offered to L2 instead. An L2 hit is promoted to
    L1 through ``to_device`` (demoting L1 victims in turn) and the device
    value is returned; if L1 cannot make room, the entry stays in L2 and a
    transient ``to_device`` copy is returned. The copies default (or None) to
    identity. Copies run under the lock; one
    that raises propagates, and the entry it was moving is dropped.

    The admission policy guards both tiers with one frequency sketch: new
    keys entering L1, and any key (put or demoted) entering L2 where that
    needs evictions. Promotions bypass it: the key was just looked up, and
    its L1 victims stay cached in L2.
    """

    def __init__(
        self,
        l1_capacity_bytes: int,
        l2_capacity_bytes: int,
        to_host: Callable[[Any], Any] | None = None,
        to_device: Callable[[Any], Any] | None = None,
        admission: "str | AdmissionPolicy | None" = None,
        *,
        expected_entries: int = 4096,
    ) -> None:
        self._l1 = _Tier(l1_capacity_bytes)
        self._l2 = _Tier(l2_capacity_bytes)
        super().__init__((self._l1, self._l2), admission, expected_entries)
        self._to_host = to_host or _identity
        self._to_device = to_device or _identity
        self._rejected = 0

    def _lookup(self, key: Hashable) -> Any | None:
        self._admission.record(key)
        l1, l2 = self._l1, self._l2
        entry = l1.entries.get(key)
        if entry is not None:
            l1.entries.move_to_end(key)
            l1.hits += 1
            return entry[0]
        l1.misses += 1
        entry = l2.entries.get(key)
        if entry is None:
            l2.misses += 1
            return None
        l2.hits += 1
        host, nbytes = entry
        victims = self._plan(l1, key, nbytes, bypass=True)
        if victims is None:
            l1.rejected += 1
            l2.entries.move_to_end(key)
            return self._to_device(host)
        device = self._to_device(host)
        l2.pop(key)
        l2.promotions += 1
        self._demote(victims)
        l1.insert(key, device, nbytes)
        return device

    def _demote(self, victims: list) -> None:
        l1, l2 = self._l1, self._l2
        for victim in victims:
            value, nbytes = l1.pop(victim)
            room = self._plan(l2, victim, nbytes, bypass=False)
            if room is None:
                l2.rejected += 1
                l1.evictions += 1
                continue
            host = self._to_host(value)
            self._evict(l2, room)
            l2.insert(victim, host, nbytes)
            l1.demotions += 1

    def put(self, key: Hashable, value: Any, nbytes: int) -> bool:
        """Store ``value`` (a device value) under ``key``; whether it was stored."""
        nbytes = _check_nbytes(nbytes)
        with self._lock:
            l1, l2 = self._l1, self._l2
            replacing = self._remove(key)
            victims = self._plan(l1, key, nbytes, bypass=replacing)
            if victims is not None:
                self._demote(victims)
                l1.insert(key, value, nbytes)
                return True
            l1.rejected += 1
            room = self._plan(l2, key, nbytes, bypass=replacing)
            if room is None:
                l2.rejected += 1
                self._rejected += 1
                return False
            host = self._to_host(value)
            self._evict(l2, room)
            l2.insert(key, host, nbytes)
            return True

    def tier_of(self, key: Hashable) -> int | None:
        """1 or 2 for the tier holding ``key``, None if absent (no stats)."""
        with self._lock:
            for level, tier in enumerate(self._tiers, start=1):
                if key in tier.entries:
                    return level
            return None

    @property
    def stats(self) -> TieredCacheStats:
        with self._lock:
            pinned = len(self._pins)
            s1, s2 = self._l1.snapshot(pinned), self._l2.snapshot(pinned)
            return TieredCacheStats(
                hits=s1.hits + s2.hits,
                misses=s2.misses,
                evictions=s1.evictions + s2.evictions,
                rejected=self._rejected,
                current_bytes=s1.current_bytes + s2.current_bytes,
                capacity_bytes=s1.capacity_bytes + s2.capacity_bytes,
                entries=s1.entries + s2.entries,
                pinned=pinned,
                demotions=s1.demotions,
                promotions=s2.promotions,
                l1=s1,
                l2=s2,
            )
