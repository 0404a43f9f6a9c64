# SPDX-License-Identifier: Apache-2.0
"""An offset allocator over one pre-allocated receive buffer.

``BufferPool`` hands out ``ALIGN``-aligned regions of ``[0, capacity)``. It is
a two-level segregated fit (TLSF): free blocks are binned by size class (8
classes per power of two) with a bitmap of non-empty classes, so ``allocate``
and ``free`` are O(1) (the bitmap scan is one big-int operation). A request is
rounded up to its class's upper bound before the search, so any block found
fits; neighbours coalesce on free through start/end maps.

``free(region, failed=True)`` quarantines the region for ``quarantine_s``:
a sender that missed the failure may still write into it out of band (shm,
Mooncake), so it must not be handed to another room until that window ends.
The pool is thread-safe; it touches no tensor memory.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from epd_encoder.errors import Overloaded
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.messages import ALIGN

_SL_BITS = 3
_SL = 1 << _SL_BITS


def _class_of(units: int) -> int:
    """The size class holding blocks of ``units`` (``units`` >= 1)."""
    if units < _SL:
        return units
    f = units.bit_length() - 1
    return (f - _SL_BITS + 1) * _SL + ((units >> (f - _SL_BITS)) & (_SL - 1))


def _search_class(units: int) -> int:
    """The lowest class whose every block holds at least ``units``."""
    if units >= _SL:
        units += (1 << (units.bit_length() - 1 - _SL_BITS)) - 1
    return _class_of(units)


class BufferPool:
    def __init__(self, capacity: int, *, align: int = ALIGN, quarantine_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 0 or align < 1 or align & (align - 1):
            raise ValueError(f"need capacity >= 0 and a power-of-two align, got {capacity}, {align}")
        self.capacity = capacity // align * align
        self.align = align
        self.quarantine_s = quarantine_s
        self._clock = clock
        self._lock = threading.Lock()
        self._bins: dict[int, dict[int, int]] = {}  # class -> {offset: units}
        self._bitmap = 0
        self._by_start: dict[int, int] = {}  # free block offset -> units
        self._by_end: dict[int, int] = {}  # free block end -> offset
        self._used: dict[int, int] = {}  # live region offset -> units
        self._quarantine: deque[tuple[float, int, int]] = deque()
        self._used_bytes = 0
        self._quarantined_bytes = 0
        if self.capacity:
            self._insert(0, self.capacity // align)

    # -- public ---------------------------------------------------------------

    def allocate(self, nbytes: int) -> Region:
        """A region of ``nbytes`` (rounded up to ``align`` internally); ``Overloaded`` if none fits now.

        A zero-byte request gets an empty region that owns nothing.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if nbytes == 0:
            return Region(0, 0)
        units = -(-nbytes // self.align)
        with self._lock:
            self._reclaim()
            offset = self._take(units)
            if offset is None:
                raise Overloaded(
                    f"receive pool cannot fit {nbytes} B now ({self._free_bytes()} B free of "
                    f"{self.capacity}, {self._quarantined_bytes} B quarantined)")
            self._used[offset] = units
            self._used_bytes += units * self.align
        return Region(offset * self.align, nbytes)

    def free(self, region: Region, *, failed: bool = False) -> None:
        """Return a live region; ``failed`` holds it in quarantine for ``quarantine_s`` first."""
        if region.nbytes == 0:
            return
        if region.offset % self.align:
            raise ValueError(f"{region} was not allocated by this pool")
        start = region.offset // self.align
        with self._lock:
            units = self._used.get(start)
            if units is None or units != -(-region.nbytes // self.align):
                raise ValueError(f"{region} is not a live region of this pool")
            del self._used[start]
            self._used_bytes -= units * self.align
            if failed and self.quarantine_s > 0:
                self._quarantine.append((self._clock() + self.quarantine_s, start, units))
                self._quarantined_bytes += units * self.align
            else:
                self._release(start, units)
            self._reclaim()

    def reclaim(self) -> None:
        """Release quarantined regions whose window has passed (also done on every call)."""
        with self._lock:
            self._reclaim()

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def quarantined_bytes(self) -> int:
        return self._quarantined_bytes

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes()

    def free_blocks(self) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` of every free block, by offset (for tests and metrics)."""
        with self._lock:
            return sorted((o * self.align, u * self.align) for o, u in self._by_start.items())

    # -- internals (lock held) ------------------------------------------------

    def _free_bytes(self) -> int:
        return self.capacity - self._used_bytes - self._quarantined_bytes

    def _take(self, units: int) -> int | None:
        mask = self._bitmap >> _search_class(units)
        if not mask:
            return self._take_exact(units)
        cls = _search_class(units) + ((mask & -mask).bit_length() - 1)
        offset, size = next(iter(self._bins[cls].items()))
        self._remove(offset, size)
        if size > units:
            self._insert(offset + units, size - units)
        return offset

    def _take_exact(self, units: int) -> int | None:
        # The rounded-up search misses a block of the request's own class that still fits:
        # check that one class so a nearly full pool can hand out its last block.
        for offset, size in self._bins.get(_class_of(units), {}).items():
            if size >= units:
                self._remove(offset, size)
                if size > units:
                    self._insert(offset + units, size - units)
                return offset
        return None

    def _insert(self, offset: int, units: int) -> None:
        cls = _class_of(units)
        self._bins.setdefault(cls, {})[offset] = units
        self._bitmap |= 1 << cls
        self._by_start[offset] = units
        self._by_end[offset + units] = offset

    def _remove(self, offset: int, units: int) -> None:
        cls = _class_of(units)
        bin_ = self._bins[cls]
        del bin_[offset]
        if not bin_:
            del self._bins[cls]
            self._bitmap &= ~(1 << cls)
        del self._by_start[offset]
        del self._by_end[offset + units]

    def _release(self, offset: int, units: int) -> None:
        before = self._by_end.get(offset)
        if before is not None:
            self._remove(before, offset - before)
            units += offset - before
            offset = before
        after = self._by_start.get(offset + units)
        if after is not None:
            self._remove(offset + units, after)
            units += after
        self._insert(offset, units)

    def _reclaim(self) -> None:
        now = self._clock()
        while self._quarantine and self._quarantine[0][0] <= now:
            _, offset, units = self._quarantine.popleft()
            self._quarantined_bytes -= units * self.align
            self._release(offset, units)
