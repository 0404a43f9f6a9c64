# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the registered-memory planes (Mooncake, NIXL)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from epd_encoder.errors import ConfigError, EncodeFailed, InvalidInput
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.messages import ALIGN
from epd_encoder.transfer.planes.pool import BufferPool


def host_buffer(nbytes: int, pin_memory: bool | None) -> torch.Tensor:
    """A uint8 host buffer, pinned by default only where CUDA can use it."""
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    except RuntimeError as e:
        raise ConfigError(f"cannot allocate a {nbytes}-byte {'pinned ' if pin else ''}host buffer") from e


def segments(flat: list[tuple[int, torch.Tensor]]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` spans covering sorted chunks; gaps shorter than ALIGN (padding) are bridged."""
    spans = [[flat[0][0], flat[0][0] + flat[0][1].numel()]]
    for off, b in flat[1:]:
        if off - spans[-1][1] < ALIGN:
            spans[-1][1] = max(spans[-1][1], off + b.numel())
        else:
            spans.append([off, off + b.numel()])
    return [(a, e - a) for a, e in spans]


def check_span(addr: int, span: int, base: int, size: int) -> None:
    """A destination must lie inside the buffer its peer announced: never an oversized write."""
    if span < 0 or addr < base or addr + span > base + size:
        raise EncodeFailed(f"destination [{addr:#x}, +{span}) lies outside the peer's buffer "
                           f"[{base:#x}, +{size})")


class RegisteredReceiverPlane:
    """The receiver side shared by one-sided-write planes (Mooncake, NIXL).

    One host buffer registered once with the engine, regions from a pool, and
    bounds checks on every access. A subclass creates its engine, calls
    ``_init_buffer``, registers ``self._base``/``self._size``, and provides
    ``info()`` and ``close()``.
    """

    name = "registered"
    in_band = False  # the sender writes the registered buffer itself; no Data frames

    def _init_buffer(self, pool_bytes: int, pin_memory: bool | None, quarantine_s: float,
                     clock: Callable[[], float]) -> None:
        if pool_bytes <= 0:
            raise ConfigError(f"pool_bytes must be positive, got {pool_bytes}")
        self._buf = host_buffer(pool_bytes, pin_memory)
        self._base = self._buf.data_ptr()
        self._mem = memoryview(self._buf.numpy())
        self._size = pool_bytes
        self._pool = BufferPool(pool_bytes, quarantine_s=quarantine_s, clock=clock)
        self.capacity = self._pool.capacity
        self._closed = False

    @property
    def pool(self) -> BufferPool:
        return self._pool

    def allocate(self, nbytes: int) -> Region:
        if self._closed:
            raise ConfigError(f"{self.name} receiver plane is closed")
        return self._pool.allocate(nbytes)

    def destination(self, region: Region) -> dict[str, Any]:
        self._check(region, 0, region.nbytes)
        return {"addr": self._base + region.offset, "nbytes": region.nbytes}

    def write_frame(self, region: Region, offset: int, frame: memoryview) -> None:
        frame = memoryview(frame).cast("B")
        n = frame.nbytes
        self._check(region, offset, n)
        if n:
            start = region.offset + offset
            self._mem[start:start + n] = frame

    def settle(self, region: Region, chunks: Sequence[tuple[int, int]]) -> str:
        return ""  # one-sided writes: nothing here can tell what landed

    def view(self, region: Region) -> torch.Tensor:
        self._check(region, 0, region.nbytes)
        return self._buf[region.offset:region.offset + region.nbytes]

    def free(self, region: Region, *, failed: bool = False) -> None:
        self._pool.free(region, failed=failed)

    def _check(self, region: Region, offset: int, nbytes: int) -> None:
        if not (0 <= region.offset and 0 <= offset and 0 <= nbytes
                and offset + nbytes <= region.nbytes and region.offset + region.nbytes <= self._size):
            raise InvalidInput(f"{nbytes} bytes at {offset} fall outside region {region} "
                               f"of a {self._size}-byte buffer")
