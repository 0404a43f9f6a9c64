# SPDX-License-Identifier: Apache-2.0
"""NIXL data plane: one-sided UCX writes into a registered receiver buffer.

The receiver's agent registers one host buffer once and publishes its agent
metadata in ``info()``; the sender loads that metadata once per receiver,
stages a room's tensors in its own registered buffer and posts one WRITE per
room at ``dest["addr"]`` plus the ``layout`` offsets. ``nixl`` is imported
lazily, so this module imports without it; building a plane without it raises
``ConfigError``. docs/transfer_nixl.md has the decisions and measurements.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.transfer.planes.staging import (
    RegisteredReceiverPlane,
    check_span,
    host_buffer,
    segments,
)

_INSTALL_HINT = ("the nixl backend needs NVIDIA NIXL with its bundled UCX: pip install nixl-cu12 "
                 "(or nixl-cu13, or the nixl meta package)")
# The meta package picks the wheel matching the host's CUDA; either wheel works alone on CPU.
_MODULES = ("nixl._bindings", "nixl_cu12._bindings", "nixl_cu13._bindings")
_MIN_STAGING = 1 << 20
_SPIN_POLLS, _NAP_STEP_S, _MAX_NAP_S = 64, 1e-5, 1e-3  # poll backoff of a running WRITE


def _bindings() -> Any:
    error: ImportError | None = None
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            error = error or e
            continue
        # A kept ImportError's traceback would pin the caller's frame, and with it a closed
        # plane's agent, until the cyclic GC runs: close() relies on the agent dying at once.
        error = None
        return module
    raise ConfigError(f"{_INSTALL_HINT} ({error})") from error


class _Agent:
    """One NIXL agent with a UCX backend, driven through the bindings.

    The bindings, not ``nixl_agent``, because only they expose the progress
    thread's poll timeout: the wrapper fixes it at 0, a busy loop on one core.
    """

    def __init__(self, name: str, *, progress_thread: bool, progress_delay_us: int,
                 ucx_tls: str | None, ucx_devices: str | None) -> None:
        nb = self._nb = _bindings()
        cfg = nb.nixlAgentConfig()
        cfg.useProgThread, cfg.useListenThread = progress_thread, False
        cfg.pthrDelay = progress_delay_us
        cfg.syncMode = nb.NIXL_THREAD_SYNC_STRICT  # several delivery threads share one agent
        params = {}
        if ucx_tls:
            params["engine_config"] = f"TLS={ucx_tls}"
        if ucx_devices:
            params["ucx_devices"] = ucx_devices
        try:
            self._a = nb.nixlAgent(name, cfg)
            self._a.createBackend("UCX", params)
        except Exception as e:
            raise ConfigError(f"cannot start a NIXL agent with a UCX backend ({params}): {e}") from e
        self.name = name
        self._regs: dict[int, Any] = {}

    def register_memory(self, ptr: int, nbytes: int) -> None:
        nb = self._nb
        reg = nb.nixlRegDList(nb.DRAM_SEG, [(ptr, nbytes, 0, "")])
        try:
            self._a.registerMem(reg, [])
        except Exception as e:
            raise ConfigError(f"NIXL registerMem of {nbytes} bytes failed: {e}") from e
        self._regs[ptr] = reg

    def unregister_memory(self, ptr: int) -> None:
        reg = self._regs.pop(ptr, None)
        if reg is not None:
            self._a.deregisterMem(reg, [])

    def metadata(self) -> bytes:
        return self._a.getLocalMD()

    def add_remote(self, metadata: bytes) -> str:
        name = self._a.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, name: str) -> None:
        self._a.invalidateRemoteMD(name)

    def post_write(self, remote: str, local: list[tuple[int, int]], dest: list[tuple[int, int]]) -> tuple[int, bool]:
        """Create and post one WRITE; ``(handle, done)``."""
        nb = self._nb
        src = nb.nixlXferDList(nb.DRAM_SEG, [(a, n, 0) for a, n in local])
        dst = nb.nixlXferDList(nb.DRAM_SEG, [(a, n, 0) for a, n in dest])
        handle = self._a.createXferReq(nb.NIXL_WRITE, src, dst, remote, "", [])
        try:
            return handle, self._done(self._a.postXferReq(handle, ""))
        except Exception:
            self.release(handle)
            raise

    def done(self, handle: int) -> bool:
        return self._done(self._a.getXferStatus(handle))

    def release(self, handle: int) -> bool:
        """Free the request, cancelling it if it still runs; False when UCX may still read its source."""
        try:
            return self._a.releaseXferReq(handle) == self._nb.NIXL_SUCCESS
        except Exception:
            return False

    def _done(self, status: Any) -> bool:
        if status == self._nb.NIXL_SUCCESS:
            return True
        if status == self._nb.NIXL_IN_PROG:
            return False
        raise EncodeFailed(f"NIXL transfer status {status}")




class NixlReceiverPlane(RegisteredReceiverPlane):
    name = "nixl"

    def __init__(self, pool_bytes: int = 256 << 20, *, ucx_tls: str | None = "tcp", ucx_devices: str | None = None,
                 progress_delay_us: int = 10_000, pin_memory: bool | None = None, quarantine_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if progress_delay_us <= 0:
            raise ConfigError(f"progress_delay_us must be positive (0 busy-polls a core), got {progress_delay_us}")
        self._init_buffer(pool_bytes, pin_memory, quarantine_s, clock)
        # The receiver's UCX worker must be progressed for writes over tcp to land: a progress thread.
        self._agent = _Agent(f"epd-rx-{uuid.uuid4().hex}", progress_thread=True,
                             progress_delay_us=progress_delay_us, ucx_tls=ucx_tls, ucx_devices=ucx_devices)
        self._agent.register_memory(self._base, pool_bytes)
        self._info = {"agent": self._agent.name, "metadata": base64.b64encode(self._agent.metadata()).decode(),
                      "base": self._base, "size": pool_bytes}

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._agent.unregister_memory(self._base)
        finally:
            # Dropping the agent disconnects every sender (their next write fails); the buffer
            # stays alive with the plane, so a write racing the close lands nowhere freed.
            self._agent = None


class _Staging:
    """Registered host buffers, one per concurrent write; a too-small one is regrown to a power of two.

    A buffer whose transfer could not be cancelled is ``retire``d: UCX may still
    read it, so it is never reused; it stays alive and registered until ``close``.
    """

    def __init__(self, agent: Any, pin_memory: bool | None) -> None:
        self._agent = agent
        self._pin = pin_memory
        self._idle: list[torch.Tensor] = []
        self._retired: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self._closed:
                raise EncodeFailed("nixl sender plane is closed")
            buf = self._idle.pop() if self._idle else None
            if buf is not None and buf.numel() >= nbytes:
                return buf
            if buf is not None:
                self._drop(buf)
            size = max(_MIN_STAGING, 1 << max(0, nbytes - 1).bit_length())
            try:
                buf = host_buffer(size, self._pin)
                self._agent.register_memory(buf.data_ptr(), size)
            except ConfigError as e:
                raise EncodeFailed(f"cannot stage {nbytes} bytes: {e}") from e
            self._all.append(buf)
            return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._closed:
                self._drop(buf)
                return
            self._idle.append(buf)
            self._idle.sort(key=torch.Tensor.numel)  # pop() hands out the largest first

    def retire(self, buf: torch.Tensor) -> None:
        with self._lock:
            (self._drop if self._closed else self._retired.append)(buf)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for buf in self._idle + self._retired:
                self._drop(buf)
            self._idle.clear()
            self._retired.clear()

    @property
    def buffers(self) -> int:
        return len(self._all)

    def _drop(self, buf: torch.Tensor) -> None:
        self._agent.unregister_memory(buf.data_ptr())
        self._all = [b for b in self._all if b is not buf]


class NixlSenderPlane:
    name = "nixl"
    takes_timeout = True  # PushSender passes its transfer_timeout

    def __init__(self, *, timeout: float = 30.0, ucx_tls: str | None = "tcp", ucx_devices: str | None = None,
                 pin_memory: bool | None = None, max_peers: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout <= 0 or max_peers < 1:
            raise ConfigError(f"need timeout > 0 and max_peers >= 1, got {timeout}, {max_peers}")
        # No progress thread: the polling writer progresses its own worker, and an idle sender costs nothing.
        self._agent = _Agent(f"epd-tx-{uuid.uuid4().hex}", progress_thread=False, progress_delay_us=10_000,
                             ucx_tls=ucx_tls, ucx_devices=ucx_devices)
        self._staging = _Staging(self._agent, pin_memory)
        self._timeout, self._max_peers, self._clock = timeout, max_peers, clock
        self._peers: OrderedDict[str, str] = OrderedDict()  # agent name -> its base64 metadata, LRU
        self._lock = threading.Lock()
        self._closed = False

    def write(self, peer_info: dict[str, Any], dest: dict[str, Any],
              chunks: Sequence[tuple[int, torch.Tensor]], send_frames: Callable[[list], None]) -> None:
        agent = self._agent
        if agent is None:
            raise EncodeFailed("nixl sender plane is closed")
        remote, metadata, addr, span = _target(peer_info, dest)
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
        self._connect(agent, remote, metadata)
        lo, hi = flat[0][0], max(off + b.numel() for off, b in flat)
        buf = self._staging.acquire(hi - lo)
        try:
            for off, b in flat:
                buf[off - lo:off - lo + b.numel()].copy_(b)
        except BaseException:
            self._staging.release(buf)
            raise
        spans = segments(flat)
        self._transfer(agent, remote, buf, [(buf.data_ptr() + s - lo, n) for s, n in spans],
                       [(addr + s, n) for s, n in spans])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._staging.close()
        self._agent = None  # a write still running holds its own reference until it returns

    def _connect(self, agent: _Agent, remote: str, metadata: str) -> None:
        with self._lock:
            known = self._peers.get(remote)
            if known == metadata:
                self._peers.move_to_end(remote)
                return
            if known is not None:
                self._forget(agent, remote)
            try:
                loaded = agent.add_remote(base64.b64decode(metadata, validate=True))
            except binascii.Error as e:
                raise EncodeFailed(f"malformed nixl metadata for agent {remote!r}") from e
            except Exception as e:
                raise EncodeFailed(f"cannot reach nixl agent {remote!r}: {e}") from e
            if loaded != remote:
                agent.remove_remote(loaded)
                raise EncodeFailed(f"nixl metadata names agent {loaded!r}, not the advertised {remote!r}")
            self._peers[remote] = metadata
            while len(self._peers) > self._max_peers:
                self._forget(agent, next(iter(self._peers)))

    def _forget(self, agent: _Agent, remote: str) -> None:
        self._peers.pop(remote, None)
        try:
            agent.remove_remote(remote)
        except Exception:
            pass  # already gone on the NIXL side

    def _transfer(self, agent: _Agent, remote: str, buf: torch.Tensor, local: list[tuple[int, int]],
                  dest: list[tuple[int, int]]) -> None:
        """Post one WRITE from ``buf`` and poll it to completion; hands ``buf`` back or retires it."""
        deadline = self._clock() + self._timeout
        try:
            handle, done = agent.post_write(remote, local, dest)
        except Exception as e:
            self._staging.release(buf)  # post_write has released its request
            self._drop_peer(agent, remote)
            raise EncodeFailed(f"nixl WRITE to {remote} was refused: {e}") from e
        freed, polls = False, 0
        try:
            while not done:
                if self._clock() >= deadline:
                    raise EncodeFailed(f"nixl WRITE to {remote} did not complete within {self._timeout}s")
                polls += 1
                if polls > _SPIN_POLLS:  # yield the GIL and the core once a transfer is clearly not instant
                    time.sleep(min(_MAX_NAP_S, _NAP_STEP_S * (polls - _SPIN_POLLS)))
                done = agent.done(handle)
        except Exception as e:
            self._drop_peer(agent, remote)
            freed = agent.release(handle)
            if isinstance(e, EncodeFailed) and freed:
                raise
            why = "" if freed else "; the transfer could not be cancelled"
            raise EncodeFailed(f"nixl WRITE to {remote} failed: {e}{why}") from e
        else:
            freed = agent.release(handle)
        finally:
            (self._staging.release if freed else self._staging.retire)(buf)

    def _drop_peer(self, agent: _Agent, remote: str) -> None:
        # After a failure the next write reloads the metadata: a restarted peer reconnects,
        # a dead one fails fast at load time.
        with self._lock:
            self._forget(agent, remote)




def _target(peer_info: dict[str, Any], dest: dict[str, Any]) -> tuple[str, str, int, int]:
    remote, metadata = peer_info.get("agent"), peer_info.get("metadata")
    base, size = peer_info.get("base"), peer_info.get("size")
    addr, span = dest.get("addr"), dest.get("nbytes")
    if not (isinstance(remote, str) and remote and isinstance(metadata, str)
            and all(type(v) is int for v in (base, size, addr, span))):
        raise EncodeFailed(f"malformed nixl destination {dest!r} for agent {remote!r}")
    check_span(addr, span, base, size)
    return remote, metadata, addr, span
