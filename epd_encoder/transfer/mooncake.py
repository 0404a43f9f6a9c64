# SPDX-License-Identifier: Apache-2.0
"""Mooncake Transfer Engine data plane: one-sided writes into a registered receiver buffer.

The receiver registers one host buffer once; the sender registers its own
staging buffers and writes each room's tensors at ``dest["addr"]`` plus the
``layout`` offsets. ``mooncake`` is imported lazily, so this module imports
without it; constructing a plane without it raises ``ConfigError``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

import torch

from epd_encoder.errors import ConfigError, EncodeFailed, Overloaded
from epd_encoder.transfer.base import Region

_INSTALL_HINT = ("the mooncake backend needs the Mooncake Transfer Engine: pip install "
                 "mooncake-transfer-engine (CUDA hosts) or mooncake-transfer-engine-non-cuda (CPU), "
                 "plus libibverbs1 from the OS")
_MIN_STAGING = 1 << 20


class RegionPool(Protocol):
    """The receiver buffer's offset allocator (``transfer/pool.py`` or the private fallback)."""

    def allocate(self, nbytes: int) -> Region: ...

    def free(self, region: Region, *, failed: bool = False) -> None: ...


def _engine(host: str, protocol: str, device_name: str) -> tuple[Any, str]:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ConfigError(_INSTALL_HINT) from e
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
    if rc != 0:
        raise ConfigError(f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
                          f"returned {rc}")
    port = engine.get_rpc_port()
    return engine, (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


def _host_buffer(nbytes: int, pin_memory: bool | None) -> torch.Tensor:
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _register(engine: Any, buf: torch.Tensor) -> None:
    rc = engine.register_memory(buf.data_ptr(), buf.numel())
    if rc != 0:
        raise ConfigError(f"mooncake register_memory of {buf.numel()} bytes returned {rc}")


class _FirstFitPool:
    """Address-ordered first-fit over ``[0, size)``; failed regions stay out until ``close``."""

    def __init__(self, size: int, align: int = 64) -> None:
        self._align = align
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> Region:
        need = max(self._align, (nbytes + self._align - 1) // self._align * self._align)
        with self._lock:
            for i, (off, n) in enumerate(self._free):
                if n >= need:
                    if n == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, n - need)
                    return Region(off, nbytes)
        raise Overloaded(f"receiver pool cannot fit {nbytes} bytes now")

    def free(self, region: Region, *, failed: bool = False) -> None:
        if failed:
            return  # a late one-sided write may still land here: never reuse it
        n = max(self._align, (region.nbytes + self._align - 1) // self._align * self._align)
        with self._lock:
            spans = sorted(self._free + [(region.offset, n)])
            merged = [spans[0]]
            for off, size in spans[1:]:
                last_off, last_n = merged[-1]
                if last_off + last_n == off:
                    merged[-1] = (last_off, last_n + size)
                else:
                    merged.append((off, size))
            self._free = merged


class MooncakeReceiverPlane:
    name = "mooncake"

    def __init__(self, pool_bytes: int, *, host: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", pin_memory: bool | None = None,
                 pool: RegionPool | None = None) -> None:
        if pool_bytes <= 0:
            raise ConfigError(f"pool_bytes must be positive, got {pool_bytes}")
        self._engine, self._session = _engine(host, protocol, device_name)
        self._buf = _host_buffer(pool_bytes, pin_memory)
        _register(self._engine, self._buf)
        self._base = self._buf.data_ptr()
        self._mem = memoryview(self._buf.numpy())
        self._size = pool_bytes
        self._pool = pool if pool is not None else _FirstFitPool(pool_bytes)
        self._closed = False

    def info(self) -> dict[str, Any]:
        return {"session": self._session, "base": self._base, "size": self._size}

    def allocate(self, nbytes: int) -> Region:
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

    def view(self, region: Region) -> torch.Tensor:
        self._check(region, 0, region.nbytes)
        return self._buf[region.offset:region.offset + region.nbytes]

    def free(self, region: Region, *, failed: bool = False) -> None:
        self._pool.free(region, failed=failed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.unregister_memory(self._base)
        # Dropping the engine closes its listener; the buffer itself stays alive with the
        # plane, so a write racing the close can never land in freed memory.
        self._engine = None

    def _check(self, region: Region, offset: int, nbytes: int) -> None:
        if not (0 <= region.offset and region.offset + region.nbytes <= self._size):
            raise ValueError(f"region {region} lies outside the {self._size}-byte buffer")
        if not (0 <= offset and nbytes >= 0 and offset + nbytes <= region.nbytes):
            raise ValueError(f"{nbytes} bytes at {offset} overflow a {region.nbytes}-byte region")


class _Staging:
    """Registered host buffers, one per concurrent write; a too-small one is regrown to a power of two."""

    def __init__(self, engine: Any, pin_memory: bool | None) -> None:
        self._engine = engine
        self._pin = pin_memory
        self._idle: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            buf = self._idle.pop() if self._idle else None
            if buf is not None and buf.numel() >= nbytes:
                return buf
            if buf is not None:
                self._drop(buf)
            size = max(_MIN_STAGING, 1 << max(0, nbytes - 1).bit_length())
            buf = _host_buffer(size, self._pin)
            _register(self._engine, buf)
            self._all.append(buf)
            return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buf)
            self._idle.sort(key=torch.Tensor.numel)  # pop() hands out the largest first

    def close(self) -> None:
        with self._lock:
            for buf in list(self._all):
                self._drop(buf)
            self._idle.clear()

    def _drop(self, buf: torch.Tensor) -> None:
        self._engine.unregister_memory(buf.data_ptr())
        self._all = [b for b in self._all if b is not buf]


class MooncakeSenderPlane:
    name = "mooncake"

    def __init__(self, *, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 pin_memory: bool | None = None) -> None:
        self._engine, self._session = _engine(host, protocol, device_name)
        self._staging = _Staging(self._engine, pin_memory)
        self._closed = False

    def write(self, peer_info: dict[str, Any], dest: dict[str, Any],
              chunks: Sequence[tuple[int, torch.Tensor]], send_frames: Callable[[list], None]) -> None:
        if self._closed:
            raise EncodeFailed("mooncake sender plane is closed")
        session, addr, span = _target(peer_info, dest)
        flat = [(off, t.detach().contiguous().reshape(-1).view(torch.uint8)) for off, t in chunks]
        flat = [(off, b) for off, b in flat if b.numel()]
        for off, b in flat:
            if off < 0 or off + b.numel() > span:
                raise EncodeFailed(f"refusing a {b.numel()}-byte write at {off} into a {span}-byte region")
        if not flat:
            return
        lo = min(off for off, _ in flat)
        hi = max(off + b.numel() for off, b in flat)
        buf = self._staging.acquire(hi - lo)
        try:
            for off, b in flat:
                buf[off - lo:off - lo + b.numel()].copy_(b)
            base = buf.data_ptr() - lo
            rc = self._engine.batch_transfer_sync_write(
                session, [base + off for off, _ in flat], [addr + off for off, _ in flat],
                [b.numel() for _, b in flat])
        finally:
            self._staging.release(buf)
        if rc != 0:
            raise EncodeFailed(f"mooncake batch_transfer_sync_write to {session} returned {rc}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._staging.close()
        self._engine = None


def _target(peer_info: dict[str, Any], dest: dict[str, Any]) -> tuple[str, int, int]:
    try:
        session, base, size = str(peer_info["session"]), int(peer_info["base"]), int(peer_info["size"])
        addr, span = int(dest["addr"]), int(dest["nbytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise EncodeFailed(f"malformed mooncake destination {dest!r} / peer {peer_info!r}") from e
    if span < 0 or addr < base or addr + span > base + size:
        raise EncodeFailed(f"destination [{addr:#x}, +{span}) lies outside the peer's buffer "
                           f"[{base:#x}, +{size})")
    return session, addr, span
