# SPDX-License-Identifier: Apache-2.0
"""Retention for pull-mode deliveries: bounded by TTL and by bytes, oldest out first."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable


class PullStore:
    """``put(key, value, nbytes)``; ``get(key)`` until ``ttl_s`` passes or bytes push it out.

    Entries are ordered by (re)insertion time, so expiry and the byte bound
    both evict from the front. A value bigger than the whole bound is not kept.
    """

    def __init__(self, *, ttl_s: float, capacity_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or capacity_bytes <= 0:
            raise ValueError("ttl_s and capacity_bytes must be positive")
        self._ttl, self._capacity, self._clock = ttl_s, capacity_bytes, clock
        self._entries: OrderedDict[Any, tuple[float, Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def current_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Any, value: Any, nbytes: int) -> bool:
        with self._lock:
            self._drop(key)
            if nbytes > self._capacity:
                return False
            self._expire(self._clock())
            while self._bytes + nbytes > self._capacity:
                self._drop(next(iter(self._entries)))
            self._entries[key] = (self._clock() + self._ttl, value, nbytes)
            self._bytes += nbytes
            return True

    def get(self, key: Any) -> Any | None:
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.get(key)
            return None if entry is None else entry[1]

    def _expire(self, now: float) -> None:
        while self._entries:
            key, (deadline, _, _) = next(iter(self._entries.items()))
            if deadline > now:
                return
            self._drop(key)

    def _drop(self, key: Any) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[2]
