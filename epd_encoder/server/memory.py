# SPDX-License-Identifier: Apache-2.0
"""Allocator tuning, so memory freed after large images goes back to the OS.

glibc raises its mmap threshold each time it frees an mmapped chunk (up to
32 MiB), so after the first large image Pillow's 16 MiB pixel blocks come
from malloc arenas, which keep freed memory: 16 decoded 7000x7000 images left
the RSS at 1.2 GiB for good (docs/operations.md, "Memory"). ``tune`` fixes
the thresholds at start-up; ``trim`` hands back what the arenas still hold
(``DrainTrimmer``: off the event loop, when the front's decode budget drains).
Both are no-ops where glibc is absent (musl, macOS).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from concurrent.futures import Executor
from typing import Any, Callable

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 << 20  # blocks this big are mmapped (fixed: never raised by frees)
TRIM_THRESHOLD = 8 << 20  # free memory above this at a heap's top goes back at once


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.malloc_trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def tune(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds (setting either stops the dynamic
    mmap threshold); returns False where it could not (no glibc)."""
    if _LIBC is None:
        return False
    ok = _LIBC.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = _LIBC.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    if not ok:
        log.warning("mallopt refused the thresholds: freed image memory may stay resident")
    return ok


def trim() -> bool:
    """``malloc_trim(0)``: return free arena pages to the OS; True if any went back."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))


class DrainTrimmer:
    """Runs ``trim`` on ``pool`` when the front's decode budget drains, once 64 MiB of
    decoded images were freed since the last trim, at most once per second. Counted
    across drains, so a stream of small images trims too (cache and pull churn with
    it); a trim due within the second runs at its end if still drained. Event-loop only."""

    AFTER_BYTES = 64 << 20
    INTERVAL_S = 1.0  # a trim walks every arena

    def __init__(self, trim: Callable[[], Any], pool: Executor, *, idle: Callable[[], bool]) -> None:
        self._trim, self._pool, self._idle = trim, pool, idle
        self._untrimmed, self._next, self._later = 0, 0.0, False

    def drained(self, freed: int) -> None:
        self._untrimmed += freed
        now = time.monotonic()
        if self._untrimmed < self.AFTER_BYTES or not self._idle():
            return
        if now < self._next:
            if not self._later:
                self._later = True
                asyncio.get_running_loop().call_later(self._next - now, self._retry)
            return
        self._untrimmed, self._next = 0, now + self.INTERVAL_S
        try:
            self._pool.submit(self._trim)
        except RuntimeError:  # the pool is shut down
            pass

    def _retry(self) -> None:
        self._later = False
        self.drained(0)
