# SPDX-License-Identifier: Apache-2.0
"""Mooncake Transfer Engine data plane: one-sided writes into a registered receiver buffer.

The receiver registers one host buffer once; the sender registers its own
staging buffers and writes each room's tensors at ``dest["addr"]`` plus the
``layout`` offsets. ``mooncake`` is imported lazily, so this module imports
without it; constructing a plane without it raises ``ConfigError``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.transfer.planes.staging import (
    RegisteredReceiverPlane,
    check_span,
    host_buffer,
    segments,
)

_INSTALL_HINT = ("the mooncake backend needs the Mooncake Transfer Engine: pip install "
                 "mooncake-transfer-engine (CUDA hosts) or mooncake-transfer-engine-non-cuda (CPU), "
                 "plus libibverbs1 from the OS")
_MIN_STAGING = 1 << 20


def _engine(host: str, protocol: str, device_name: str) -> tuple[Any, str]:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ConfigError(f"{_INSTALL_HINT} ({e})") from e
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
    if rc != 0:
        raise ConfigError(f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
                          f"returned {rc}")
    port = engine.get_rpc_port()
    return engine, (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")




def _register(engine: Any, buf: torch.Tensor) -> None:
    rc = engine.register_memory(buf.data_ptr(), buf.numel())
    if rc != 0:
        raise ConfigError(f"mooncake register_memory of {buf.numel()} bytes returned {rc}")


class MooncakeReceiverPlane(RegisteredReceiverPlane):
    name = "mooncake"

    def __init__(self, pool_bytes: int = 256 << 20, *, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", pin_memory: bool | None = None, quarantine_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._init_buffer(pool_bytes, pin_memory, quarantine_s, clock)
        self._engine, self._session = _engine(hostname, protocol, device_name)
        _register(self._engine, self._buf)

    def info(self) -> dict[str, Any]:
        return {"session": self._session, "base": self._base, "size": self._size}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.unregister_memory(self._base)
        # Dropping the engine closes its listener; the buffer itself stays alive with the
        # plane, so a write racing the close can never land in freed memory.
        self._engine = None


class _Staging:
    """Registered host buffers, one per concurrent write; a too-small one is regrown to a power of two."""

    def __init__(self, engine: Any, pin_memory: bool | None) -> None:
        self._engine = engine
        self._pin = pin_memory
        self._idle: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self._closed:
                raise EncodeFailed("mooncake sender plane is closed")
            buf = self._idle.pop() if self._idle else None
            if buf is not None and buf.numel() >= nbytes:
                return buf
            if buf is not None:
                self._drop(buf)
            size = max(_MIN_STAGING, 1 << max(0, nbytes - 1).bit_length())
            try:
                buf = host_buffer(size, self._pin)
                _register(self._engine, buf)
            except ConfigError as e:
                raise EncodeFailed(f"cannot stage {nbytes} bytes: {e}") from e
            self._all.append(buf)
            return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buf)
            self._idle.sort(key=torch.Tensor.numel)  # pop() hands out the largest first

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for buf in list(self._all):
                self._drop(buf)
            self._idle.clear()

    def _drop(self, buf: torch.Tensor) -> None:
        self._engine.unregister_memory(buf.data_ptr())
        self._all = [b for b in self._all if b is not buf]


class MooncakeSenderPlane:
    name = "mooncake"

    def __init__(self, *, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 pin_memory: bool | None = None) -> None:
        self._engine, self._session = _engine(hostname, protocol, device_name)
        self._staging = _Staging(self._engine, pin_memory)
        self._closed = False

    def write(self, peer_info: dict[str, Any], dest: dict[str, Any],
              chunks: Sequence[tuple[int, torch.Tensor]], send_frames: Callable[[list], None]) -> None:
        engine = self._engine
        if engine is None:
            raise EncodeFailed("mooncake sender plane is closed")
        session, addr, span = _target(peer_info, dest)
        flat = []
        for off, t in chunks:
            b = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if type(off) is not int or off < 0 or off + b.numel() > span:
                raise EncodeFailed(f"refusing a {b.numel()}-byte write at {off} into a {span}-byte region")
            if b.numel():
                flat.append((off, b))
        if not flat:
            return
        flat.sort(key=lambda c: c[0])
        lo, hi = flat[0][0], max(off + b.numel() for off, b in flat)
        buf = self._staging.acquire(hi - lo)
        try:
            for off, b in flat:
                buf[off - lo:off - lo + b.numel()].copy_(b)
            spans = segments(flat)
            rc = engine.batch_transfer_sync_write(
                session, [buf.data_ptr() + start - lo for start, _ in spans],
                [addr + start for start, _ in spans], [n for _, n in spans])
        finally:
            self._staging.release(buf)
        if rc != 0:
            raise EncodeFailed(f"mooncake batch_transfer_sync_write to {session} returned {rc}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine = None
        self._staging.close()




def _target(peer_info: dict[str, Any], dest: dict[str, Any]) -> tuple[str, int, int]:
    session, base, size = peer_info.get("session"), peer_info.get("base"), peer_info.get("size")
    addr, span = dest.get("addr"), dest.get("nbytes")
    if not (isinstance(session, str) and all(type(v) is int for v in (base, size, addr, span))):
        raise EncodeFailed(f"malformed mooncake destination {dest!r} for peer {peer_info!r}")
    check_span(addr, span, base, size)
    return session, addr, span
