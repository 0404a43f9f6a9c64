# SPDX-License-Identifier: Apache-2.0
"""Same-host shared-memory data plane: the sender writes straight into the receiver's segment.

The receiver owns one POSIX shared-memory file (``<shm_dir>/epd-rx-<pid>-<hex>``),
created, sized and populated once; rooms get regions of it from a pool. The
sender maps the segment by name and copies each tensor into place with a
GIL-releasing ``torch`` copy. Python's ``SharedMemory`` is not used: before
3.13 every process that attaches registers the segment with its
``resource_tracker``, which unlinks it when that process exits.

Liveness is an ``flock`` the owner holds on the segment for its lifetime. The
kernel drops it when the owner dies (even by SIGKILL), so a starting receiver
can sweep segments whose lock it can take without trusting pids (reused, or
from another pid namespace). Only the owner unlinks; a sender only unmaps.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import socket
import stat
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from epd_encoder.errors import ConfigError, EncodeFailed, InvalidInput
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.planes.pool import BufferPool

PREFIX = "epd-rx-"
DEFAULT_SHM_DIR = "/dev/shm"
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def host_identity() -> tuple[str, str]:
    """``(hostname, boot_id)``; the boot id differs across machines and reboots."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def sweep_stale(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Unlink every ``epd-rx-*`` segment whose owner is gone; returns the names removed."""
    removed = []
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(PREFIX)]
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # the owner is alive
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
                    removed.append(name)
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)
    return removed


def _tensor_over(mm: mmap.mmap) -> torch.Tensor:
    # frombuffer keeps the object but not a buffer export; going through a memoryview makes
    # mm.close() raise BufferError while any view is alive instead of unmapping under it.
    return torch.frombuffer(memoryview(mm), dtype=torch.uint8)


def _unlink_owned(path: str, fd: int, owner_pid: int) -> None:
    # A forked child inherits the finalizer; only the creating process unlinks.
    if os.getpid() != owner_pid:
        return
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass


def _create_segment(shm_dir: str) -> tuple[str, str, int]:
    while True:
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"cannot create a shm segment in {shm_dir}: {e}") from e
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            ours = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            ours = False  # a sweeper took it between create and lock
        if ours:
            return name, path, fd
        os.close(fd)


class ShmReceiverPlane:
    name = "shm"
    in_band = False  # the sender writes the segment itself; no Data frames

    def __init__(self, pool_bytes: int = 256 << 20, *, quarantine_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, shm_dir: str = DEFAULT_SHM_DIR) -> None:
        if pool_bytes <= 0:
            raise ConfigError(f"shm pool_bytes must be positive, got {pool_bytes}")
        self.swept = sweep_stale(shm_dir)
        self._size = pool_bytes
        self._hostname, self._boot_id = host_identity()
        self.segment, self.path, self._fd = _create_segment(shm_dir)
        self._finalizer = weakref.finalize(self, _unlink_owned, self.path, self._fd, os.getpid())
        try:
            # Reserve every page now: a full tmpfs must fail here, not SIGBUS a later write.
            os.posix_fallocate(self._fd, 0, pool_bytes)
            self._mm = mmap.mmap(self._fd, pool_bytes, flags=_MAP_FLAGS)
        except OSError as e:
            self._finalizer()
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ConfigError(f"{shm_dir} cannot hold a {pool_bytes}-byte shm pool") from e
            raise
        self._inode = os.fstat(self._fd).st_ino
        self._base = _tensor_over(self._mm)
        self._closed = False
        self._pool = BufferPool(pool_bytes, quarantine_s=quarantine_s, clock=clock)
        self.capacity = self._pool.capacity

    def info(self) -> dict[str, Any]:
        return {"segment": self.segment, "size": self._size, "host": self._hostname,
                "boot_id": self._boot_id, "inode": self._inode}

    def allocate(self, nbytes: int) -> Region:
        if self._closed:
            raise ConfigError("shm receiver plane is closed")
        return self._pool.allocate(nbytes)

    def destination(self, region: Region) -> dict[str, Any]:
        return {"offset": region.offset, "nbytes": region.nbytes}

    def write_frame(self, region: Region, offset: int, frame: memoryview) -> None:
        n = memoryview(frame).nbytes
        self._check(region, offset, n)
        start = region.offset + offset
        self._mm[start:start + n] = frame

    def settle(self, region: Region, chunks: Sequence[tuple[int, int]]) -> str:
        return ""  # one-sided writes: nothing here can tell what landed

    def view(self, region: Region) -> torch.Tensor:
        self._check(region, 0, region.nbytes)
        return self._base[region.offset:region.offset + region.nbytes]

    def free(self, region: Region, *, failed: bool = False) -> None:
        self._pool.free(region, failed=failed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._base = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes with the last one

    @property
    def pool(self) -> BufferPool:
        return self._pool

    def _check(self, region: Region, offset: int, nbytes: int) -> None:
        if self._closed:
            raise ConfigError("shm receiver plane is closed")
        if not (0 <= region.offset and 0 <= offset and 0 <= nbytes
                and offset + nbytes <= region.nbytes and region.offset + region.nbytes <= self._size):
            raise InvalidInput(f"{nbytes} bytes at {offset} fall outside region {region} "
                               f"of a {self._size}-byte segment")


@dataclass
class _Mapping:
    mm: mmap.mmap
    base: torch.Tensor
    inode: int

    def close(self) -> None:
        self.base = torch.empty(0, dtype=torch.uint8)
        try:
            self.mm.close()
        except BufferError:
            pass  # another thread is mid-copy; the mapping goes when its view does


class ShmSenderPlane:
    name = "shm"

    def __init__(self, *, shm_dir: str = DEFAULT_SHM_DIR, max_segments: int = 16) -> None:
        self._dir = shm_dir
        self._hostname, self._boot_id = host_identity()
        self._lock = threading.Lock()
        # LRU of mapped receiver segments: receivers come and go, and a stale mapping
        # would keep an unlinked segment's pages alive in this process.
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._max_maps = max_segments

    def write(self, peer_info: dict[str, Any], dest: dict[str, Any],
              chunks: Sequence[tuple[int, torch.Tensor]], send_frames: Callable[[list], None]) -> None:
        segment = peer_info.get("segment")
        if not isinstance(segment, str) or not segment.startswith(PREFIX) or "/" in segment:
            raise EncodeFailed(f"not an epd shm segment name: {segment!r}")
        boot = peer_info.get("boot_id")
        if boot and self._boot_id and boot != self._boot_id:
            raise ConfigError(f"shm segment {segment} is on host {peer_info.get('host')!r}, "
                              f"not this one ({self._hostname!r}); use the tcp backend across hosts")
        region_off, region_n = dest.get("offset"), dest.get("nbytes")
        if not (type(region_off) is int and type(region_n) is int and region_off >= 0 and region_n >= 0):
            raise EncodeFailed(f"malformed shm destination {dest!r}")
        srcs = []
        for off, tensor in chunks:
            n = tensor.numel() * tensor.element_size()
            if not (type(off) is int and off >= 0 and off + n <= region_n):
                raise EncodeFailed(f"{n} bytes at {off} overflow the {region_n}-byte destination")
            if n:
                srcs.append((region_off + off, n, tensor))
        base = self._mapping(segment, peer_info.get("inode"))
        if region_off + region_n > base.numel():
            raise EncodeFailed(f"destination {dest!r} overflows the {base.numel()}-byte segment {segment}")
        for start, n, tensor in srcs:
            src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            base[start:start + n].copy_(src)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for m in maps.values():
            m.close()

    def _mapping(self, segment: str, inode: Any) -> torch.Tensor:
        # The returned view pins the mapping: a concurrent close() cannot unmap it mid-copy.
        path = os.path.join(self._dir, segment)
        with self._lock:
            cached = self._maps.get(segment)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            if cached is not None and (st is None or st.st_ino != cached.inode):
                del self._maps[segment]
                cached.close()
                cached = None
            if st is None:
                raise EncodeFailed(f"shm segment {segment} does not exist in {self._dir}: the receiver "
                                   "is gone or on another host / IPC namespace")
            if inode is not None and st.st_ino != inode:
                raise ConfigError(f"shm segment {segment} is not the receiver's (inode {st.st_ino} "
                                  f"!= {inode}): another /dev/shm namespace?")
            if cached is None:
                self._prune()
                cached = self._open(path)
                self._maps[segment] = cached
            self._maps.move_to_end(segment)
            return cached.base

    def _prune(self) -> None:
        # Lock held. Drop mappings whose segment is gone, then the least recent over the cap.
        for name in [n for n in self._maps if not os.path.exists(os.path.join(self._dir, n))]:
            self._maps.pop(name).close()
        while len(self._maps) >= self._max_maps:
            self._maps.popitem(last=False)[1].close()

    def _open(self, path: str) -> _Mapping:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise EncodeFailed(f"cannot open shm segment {path}: {e}") from e
        try:
            st = os.fstat(fd)
            mm = mmap.mmap(fd, st.st_size, flags=_MAP_FLAGS)
        except (OSError, ValueError) as e:
            raise EncodeFailed(f"cannot map shm segment {path}: {e}") from e
        finally:
            os.close(fd)
        return _Mapping(mm, _tensor_over(mm), st.st_ino)
