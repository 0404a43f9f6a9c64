# SPDX-License-Identifier: Apache-2.0
"""The two-tier cache: L1 on the encode device, L2 in host memory, exclusive.

It keeps the contract documented in ``epd_encoder.cache.lru``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

from epd_encoder.cache.admission import AdmissionPolicy
from epd_encoder.cache.lru import (
    InTransit,
    TieredCacheStats,
    _BaseCache,
    _check_nbytes,
    _Tier,
)

__all__ = ["TieredEmbeddingCache"]

log = logging.getLogger(__name__)


def _identity(value: Any) -> Any:
    return value


Move = tuple[_Tier, Hashable, InTransit, Callable[[Any], Any]]


class TieredEmbeddingCache(_BaseCache):
    """Two exclusive bytes-bounded LRU tiers: L1 on the encode device, L2 in host memory.

    A key lives in at most one tier. ``put`` stores into L1; L1 victims are
    demoted to L2 through ``to_host``. A value L1 refuses (too big, pinned
    full, or not admitted) is offered to L2 instead. An L2 hit is promoted to
    L1 through ``to_device`` (demoting L1 victims in turn) and the device
    value is returned; if L1 cannot make room, the entry stays in L2 and a
    transient ``to_device`` copy is returned. The copies default (or None) to
    identity.

    Copies run outside the lock (on a device each waits for queued GPU work, and
    the event loop pins under this lock): the entry is placed in its destination
    tier as ``InTransit`` under the lock, copied, then committed under the lock
    if it is still there. Meanwhile a lookup of a demoting entry gets its device
    value, a lookup of a promoting one waits for the copy, and ``pin``, ``in``
    and the byte counts see the entry where it is going. A copy that raises
    propagates from the call that made it, and the entry it was moving is dropped.

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

    def get(self, key: Hashable) -> Any | None:
        return self._get(key, pin=False)

    def acquire(self, key: Hashable) -> Any | None:
        return self._get(key, pin=True)

    def _get(self, key: Hashable, *, pin: bool) -> Any | None:
        with self._lock:
            self._admission.record(key)
        while True:
            with self._lock:
                found = self._find(key)
                if isinstance(found, InTransit):  # a promotion under way: wait, look again
                    wait = found.done
                elif found is None:
                    return None
                else:
                    if pin:
                        self._pins[key] = self._pins.get(key, 0) + 1
                    if found[0] is not None:
                        return found[0]
                    host, moves = found[1], found[2]
            if isinstance(found, InTransit):
                wait.wait()
                continue
            try:
                if not moves:
                    return self._to_device(host)  # a transient copy: L1 has no room
                return self._finish(moves, own=True)
            except BaseException:
                if pin:
                    self.release(key)
                raise

    def _find(self, key: Hashable) -> "InTransit | tuple[Any, Any, list[Move]] | None":
        """Under the lock: a promoting entry to wait for, None on a miss, else
        ``(value, None, [])`` for a value to return now, or ``(None, host, moves)``
        for one to copy first (no moves: a transient copy)."""
        l1, l2 = self._l1, self._l2
        entry = l1.entries.get(key)
        if entry is not None and isinstance(entry[0], InTransit):
            return entry[0]
        if entry is not None:
            l1.entries.move_to_end(key)
            l1.hits += 1
            return entry[0], None, []
        l1.misses += 1
        entry = l2.entries.get(key)
        if entry is None:
            l2.misses += 1
            return None
        l2.hits += 1
        value, nbytes = entry
        if isinstance(value, InTransit):  # being demoted: its device value is still good
            l2.entries.move_to_end(key)
            return value.source, None, []
        victims = self._plan(l1, key, nbytes, bypass=True)
        if victims is None:
            l1.rejected += 1
            l2.entries.move_to_end(key)
            return None, value, []
        l2.pop(key)
        l2.promotions += 1
        marker = InTransit(value)
        moves: list[Move] = [(l1, key, marker, self._to_device)]
        moves += self._demote(victims)
        l1.insert(key, marker, nbytes)
        return None, value, moves

    def _demote(self, victims: list) -> list[Move]:
        """Under the lock: take ``victims`` out of L1 and place them in L2, in transit."""
        l1, l2, moves = self._l1, self._l2, []
        for victim in victims:
            value, nbytes = l1.pop(victim)
            room = self._plan(l2, victim, nbytes, bypass=False)
            if room is None:
                l2.rejected += 1
                l1.evictions += 1
                continue
            self._evict(l2, room)
            marker = InTransit(value)
            l2.insert(victim, marker, nbytes)
            moves.append((l2, victim, marker, self._to_host))
            l1.demotions += 1
        return moves

    def _finish(self, moves: list[Move], *, own: bool) -> Any:
        """Outside the lock: run each copy, then commit it where its entry still waits (a
        failed copy drops its entry: never half an entry). With ``own`` the first move is
        the caller's entry: its copy is returned, its error raised once every move has
        ended. A victim's failed demotion is an eviction, logged."""
        first, error = None, None
        for i, (tier, key, marker, copy) in enumerate(moves):
            failed = False
            try:
                out = copy(marker.source)
            except BaseException as e:
                out, failed = None, True
                if own and i == 0:
                    error = e
                else:
                    log.exception("demoting a cache entry failed; it is dropped")
            with self._lock:
                entry = tier.entries.get(key)
                if entry is not None and entry[0] is marker:
                    if failed:
                        tier.pop(key)
                        tier.evictions += 1
                    else:
                        tier.entries[key] = (out, entry[1])  # keeps its LRU place
            marker.done.set()
            if i == 0:
                first = out
        if error is not None:
            raise error
        return first

    def put(self, key: Hashable, value: Any, nbytes: int) -> bool:
        """Store ``value`` (a device value) under ``key``; whether it was stored."""
        nbytes = _check_nbytes(nbytes)
        with self._lock:
            l1, l2 = self._l1, self._l2
            replacing = self._remove(key)
            victims = self._plan(l1, key, nbytes, bypass=replacing)
            own = victims is None
            if victims is not None:
                moves = self._demote(victims)
                l1.insert(key, value, nbytes)
            else:
                l1.rejected += 1
                room = self._plan(l2, key, nbytes, bypass=replacing)
                if room is None:
                    l2.rejected += 1
                    self._rejected += 1
                    return False
                self._evict(l2, room)
                marker = InTransit(value)
                l2.insert(key, marker, nbytes)
                moves = [(l2, key, marker, self._to_host)]
        if moves:
            self._finish(moves, own=own)
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
