# SPDX-License-Identifier: Apache-2.0
"""The ``tcp`` data plane's receiver and wire format: bytes on plain TCP, received straight into the pool.

The receiver plane listens on its own data port (``info()``: ``data_host``,
``data_port``) and serves each connection on a thread of its own. A write is
a fixed header (magic, the room's 16-byte destination token, offset in the
region, nbytes) and the bytes, which the serving thread ``recv_into``s the
room's region; after the last byte it answers one ``0x01``. The token is a
random name ``destination(region)`` hands out in ``Accept.dest``; a header
with an unknown or settled token, or one that reaches outside its region, is
never written: the connection is closed and the region marked bad, so the
room's ``Written`` is answered ``Ack(ok=False)``. ``settle`` seals the token
and ``free`` drops it, so a freed region takes no late write (a write still
in flight defers the free until it ends): no quarantine is needed.

A write may be any byte range of the region: ``settle`` checks that the
writes cover exactly the layout's tensors, no more, no overlap. The sender
(``transfer/planes/tcp_sender.py``) may thus split a room over parallel streams.
"""

from __future__ import annotations

import secrets
import select
import socket
import struct
import threading
import time
from typing import Any, Sequence

import torch

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.planes.pool import BufferPool

HEADER = struct.Struct("!4s16sQQ")  # magic, destination token, offset in the region, nbytes
MAGIC = b"EPD1"
OK = b"\x01"
_MAX_WRITES = 1 << 16  # per region: bounds the bookkeeping a sender can make the receiver keep


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))


def tune(sock: socket.socket, sock_buf: int, io_timeout: float) -> None:
    """TCP_NODELAY, ``sock_buf`` (0: kernel autotuning) and kernel send/receive timeouts."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sock_buf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sock_buf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sock_buf)
    # Blocking sockets with kernel timeouts: Python's own timeouts add a poll() per call.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(io_timeout))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(io_timeout))


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``ConnectionResetError`` on EOF, ``BlockingIOError`` on timeout."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("peer closed the data connection")
        got += n


def _spans(ranges: Sequence[tuple[int, int]]) -> list[list[int]] | None:
    """Merged ``[start, end)`` spans of ``(offset, nbytes)`` ranges; ``None`` if two overlap."""
    out: list[list[int]] = []
    for off, n in sorted(ranges):
        if out and off < out[-1][1]:
            return None
        if out and off == out[-1][1]:
            out[-1][1] = off + n
        else:
            out.append([off, off + n])
    return out


def _check_coverage(written: Sequence[tuple[int, int]], want: Sequence[tuple[int, int]]) -> str:
    # A sender may split a tensor across writes (streams): what matters is the bytes covered.
    got = _spans(written)
    if got is None:
        return "data writes overlap"
    if got == _spans(want):
        return ""
    missing = sum(1 for off, n in want if not any(a <= off and off + n <= e for a, e in got))
    if missing:
        return f"{missing} tensors never arrived"
    return "data writes fall outside the offered layout"


class _Slot:
    __slots__ = ("region", "written", "writing", "bad", "sealed", "freed")

    def __init__(self, region: Region) -> None:
        self.region = region
        self.written: list[tuple[int, int]] = []
        self.writing = 0
        self.bad = ""
        self.sealed = self.freed = False


class TcpReceiverPlane:
    name = "tcp"
    in_band = False  # bytes arrive on the plane's own data connections
    listens = True  # the receiver passes its host / advertise_host

    def __init__(self, pool_bytes: int = 256 << 20, *, host: str = "127.0.0.1", data_port: int = 0,
                 advertise_host: str | None = None, sock_buf: int = 0, io_timeout: float = 30.0,
                 max_connections: int = 256, pin_memory: bool = False) -> None:
        if pool_bytes <= 0:
            raise ConfigError(f"tcp pool_bytes must be positive, got {pool_bytes}")
        self._buf = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._buf.zero_()  # fault every page in now, not during a room's receive
        self._mem = memoryview(self._buf.numpy())
        self._pool = BufferPool(pool_bytes)
        self.capacity = self._pool.capacity
        self._sock_buf, self._io_timeout, self._max_conns = sock_buf, io_timeout, max_connections
        self._lock = threading.Lock()
        self._slots: dict[bytes, _Slot] = {}
        self._by_offset: dict[int, bytes] = {}
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.stats = {"connections": 0, "refused_writes": 0, "broken_writes": 0}
        bind_host = "" if host in ("*", "0.0.0.0") else host
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        try:
            self._listener = socket.socket(family, socket.SOCK_STREAM)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if sock_buf:  # on the listener, so the window scale is negotiated for it
                self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sock_buf)
            self._listener.bind((bind_host, data_port))
            self._listener.listen(64)
        except OSError as e:
            self._listener.close()
            raise ConfigError(f"cannot listen for tcp data on {host}:{data_port}: {e}") from e
        self._listener.settimeout(0.2)
        self.data_host = advertise_host or host
        self.data_port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"epd-rx-data-{self.data_port}",
                                          daemon=True)
        self._acceptor.start()

    def info(self) -> dict[str, Any]:
        return {"pool_bytes": self.capacity, "data_host": self.data_host, "data_port": self.data_port}

    def allocate(self, nbytes: int) -> Region:
        if self._closed:
            raise ConfigError("tcp receiver plane is closed")
        return self._pool.allocate(nbytes)

    def destination(self, region: Region) -> dict[str, Any]:
        if not region.nbytes:
            return {"token": "", "nbytes": 0}
        token = secrets.token_bytes(16)
        with self._lock:
            old = self._by_offset.get(region.offset)
            if old is not None:
                self._slots.pop(old, None)
            self._slots[token] = _Slot(region)
            self._by_offset[region.offset] = token
        return {"token": token.hex(), "nbytes": region.nbytes}

    def write_frame(self, region: Region, offset: int, frame: memoryview) -> None:
        raise EncodeFailed("the tcp plane takes no in-band frames")

    def settle(self, region: Region, chunks: Sequence[tuple[int, int]]) -> str:
        want = [c for c in chunks if c[1]]
        if not region.nbytes:
            return f"{len(want)} tensors never arrived" if want else ""
        with self._lock:
            slot = self._slots.get(self._by_offset.get(region.offset, b""))
            if slot is None or slot.region != region:
                return "the region has no live destination"
            slot.sealed = True
            if slot.bad:
                return slot.bad
            if slot.writing:
                return "a data write was still in flight when the sender said it was done"
            written = list(slot.written)
        return _check_coverage(written, want)

    def view(self, region: Region) -> torch.Tensor:
        return self._buf[region.offset:region.offset + region.nbytes]

    def free(self, region: Region, *, failed: bool = False) -> None:
        if not region.nbytes:
            return
        with self._lock:
            token = self._by_offset.get(region.offset)
            slot = self._slots.get(token) if token is not None else None
            if slot is not None and slot.region == region:
                del self._by_offset[region.offset], self._slots[token]
                slot.sealed = slot.freed = True
                if slot.writing:
                    return  # the writing thread frees it once its recv ends
        self._pool.free(region)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        for c in [self._listener, *conns]:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes its thread out of accept / poll / recv
            except OSError:
                pass
        self._acceptor.join(timeout=2.0)
        # Joined, not left to die at exit: a thread killed while dropping its view of the
        # torch buffer aborts the process (libstdc++ "terminate called without ..."). Woken by
        # the shutdown above, each ends within its socket timeout.
        with self._lock:
            threads = list(self._threads)
        deadline = time.monotonic() + self._io_timeout
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._listener.close()
        # Views handed out (copy=False results) keep the old storage alive until they go.
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._mem = memoryview(self._buf.numpy())

    @property
    def pool(self) -> BufferPool:
        return self._pool

    # -- data connections (their own threads) ---------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._closed:
                    return
                continue
            with self._lock:
                if self._closed or len(self._conns) >= self._max_conns:
                    conn.close()
                    continue
                self._conns.add(conn)
                self.stats["connections"] += 1
            conn.setblocking(True)
            tune(conn, self._sock_buf, self._io_timeout)
            thread = threading.Thread(target=self._serve, args=(conn,), name=f"epd-rx-data-{self.data_port}-conn",
                                      daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        header, mem = memoryview(bytearray(HEADER.size)), self._mem  # mem outlives close()
        idle = select.poll()
        idle.register(conn, select.POLLIN)
        try:
            while not self._closed:
                idle.poll()  # an idle connection waits without a timeout; close() wakes it
                got = conn.recv_into(header)
                if got == 0:
                    return
                recv_exact(conn, header[got:])
                magic, token, off, nbytes = HEADER.unpack(header)
                slot = self._begin(magic, token, off, nbytes)
                if slot is None:
                    return  # never written: closing tells the sender its write was refused
                start = slot.region.offset + off
                try:
                    recv_exact(conn, mem[start:start + nbytes])
                except OSError:
                    self._end(slot, off, nbytes, "the data connection broke mid-write")
                    raise
                self._end(slot, off, nbytes, "")
                conn.sendall(OK)
        except (OSError, ValueError):
            with self._lock:
                self.stats["broken_writes"] += 0 if self._closed else 1
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                if not self._closed:  # once closing, close() joins it: it stays in the set
                    self._threads.discard(threading.current_thread())

    def _begin(self, magic: bytes, token: bytes, off: int, nbytes: int) -> _Slot | None:
        with self._lock:
            slot = self._slots.get(token) if magic == MAGIC else None
            if slot is None or slot.sealed:
                self.stats["refused_writes"] += 1
                return None
            if not 0 < nbytes <= slot.region.nbytes - off or len(slot.written) >= _MAX_WRITES:
                slot.bad = slot.bad or (f"refused a data write of {nbytes} B at {off}: outside the "
                                        f"{slot.region.nbytes}-byte region or past {_MAX_WRITES} writes")
                self.stats["refused_writes"] += 1
                return None
            slot.writing += 1
            return slot

    def _end(self, slot: _Slot, off: int, nbytes: int, error: str) -> None:
        with self._lock:
            slot.writing -= 1
            if error:
                slot.bad = slot.bad or error
            else:
                slot.written.append((off, nbytes))
            release = slot.freed and not slot.writing
        if release:
            self._pool.free(slot.region)
