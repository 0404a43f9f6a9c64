# SPDX-License-Identifier: Apache-2.0
"""The sender half of the ``tcp`` data plane (wire format and receiver: ``transfer/planes/tcp.py``).

``TcpSenderPlane`` keeps ``streams`` connections per receiver data address.
A room smaller than ``stripe_min`` goes on one of them; a larger one is cut
into ``streams`` contiguous stripes sent in parallel (one measured TCP stream
on loopback is bound by its window round trips, not by the copies). Every
write is a header plus ``sendmsg`` of memoryviews of the contiguous tensors
(no copies); ``write`` returns once every write's ack came back, i.e. once
every byte is in the receiver's region.
"""

from __future__ import annotations

import select
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from epd_encoder.errors import ConfigError, EncodeFailed, RequestTimeout
from epd_encoder.transfer.base import host_bytes
from epd_encoder.transfer.planes.tcp import HEADER, MAGIC, OK, recv_exact, tune

_IOV_MAX = 512
_CUT_ALIGN = 4096  # stripe boundaries inside a tensor fall on page multiples of the region

Piece = tuple[int, memoryview]  # (offset in the region, bytes)


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def stale(self) -> bool:
        # Nothing is due on an idle connection: readable means EOF, an error or garbage.
        p = select.poll()
        try:
            p.register(self.sock, select.POLLIN)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True


class TcpSenderPlane:
    name = "tcp"
    takes_timeout = True  # PushSender passes its transfer_timeout: a write blocks at most that long

    def __init__(self, *, streams: int = 2, stripe_min: int = 4 << 20, timeout: float = 30.0,
                 connect_timeout: float = 5.0, sock_buf: int = 0, max_workers: int = 8,
                 max_conns: int = 128) -> None:
        if streams < 1 or stripe_min < 0:
            raise ConfigError(f"need streams >= 1 and stripe_min >= 0, got {streams}, {stripe_min}")
        self.streams, self.stripe_min = streams, stripe_min
        self._timeout, self._connect_timeout, self._sock_buf = timeout, connect_timeout, sock_buf
        self._lock = threading.Lock()
        self._conns: dict[tuple[tuple[str, int], int], _Conn] = {}
        self._max_conns = max_conns
        self._workers = ThreadPoolExecutor(max_workers, thread_name_prefix="epd-tx-tcp") if streams > 1 else None
        self._closed = False

    def write(self, peer_info: dict[str, Any], dest: dict[str, Any],
              chunks: Sequence[tuple[int, torch.Tensor]], send_frames: Callable[[list], None]) -> None:
        addr, token, span = _target(peer_info, dest)
        pieces: list[Piece] = []
        for off, tensor in chunks:
            view = host_bytes(tensor)
            if not (type(off) is int and 0 <= off and off + view.nbytes <= span):
                raise EncodeFailed(f"{view.nbytes} bytes at {off} overflow the {span}-byte destination")
            if view.nbytes:
                pieces.append((off, view))
        total = sum(v.nbytes for _, v in pieces)
        if not total:
            return
        n = self.streams if total >= self.stripe_min else 1
        stripes = _stripes(pieces, total, n) if n > 1 else [pieces]
        futures: list[Future] = []
        if self._workers is not None:
            futures = [self._workers.submit(self._send, addr, i, token, s) for i, s in enumerate(stripes[1:], 1)]
        errors: list[BaseException] = []
        try:
            self._send(addr, 0, token, stripes[0])
        except Exception as e:  # still wait for the other stripes: they read the caller's tensors
            errors.append(e)
        for f in futures:
            if (e := f.exception()) is not None:
                errors.append(e)
        if errors:
            raise errors[0]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
        if self._workers is not None:
            self._workers.shutdown(wait=True)
        for c in conns:
            c.sock.close()

    def _send(self, addr: tuple[str, int], stream: int, token: bytes, pieces: list[Piece]) -> None:
        bufs: list[memoryview] = []
        for off, view in pieces:
            bufs += [memoryview(HEADER.pack(MAGIC, token, off, view.nbytes)), view]
        conn = self._connection(addr, stream)
        where = f"{addr[0]}:{addr[1]}"
        with conn.lock:
            try:
                _send_all(conn.sock, bufs)
                acks = memoryview(bytearray(len(pieces)))
                recv_exact(conn.sock, acks)
            except BlockingIOError as e:
                self._drop(addr, stream, conn)
                raise RequestTimeout(f"tcp data write to {where} stalled for {self._timeout}s") from e
            except OSError as e:
                self._drop(addr, stream, conn)
                raise EncodeFailed(f"tcp data connection to {where} failed (the receiver refused the "
                                   f"write or is gone): {e}") from e
            if acks != OK * len(acks):
                self._drop(addr, stream, conn)
                raise EncodeFailed(f"tcp data connection to {where} sent a malformed ack")

    def _connection(self, addr: tuple[str, int], stream: int) -> _Conn:
        key = (addr, stream)
        with self._lock:
            if self._closed:
                raise EncodeFailed("tcp sender plane is closed")
            conn = self._conns.get(key)
        if conn is not None and not conn.lock.locked() and conn.stale():
            self._drop(addr, stream, conn)
            conn = None
        if conn is None:
            try:
                sock = socket.create_connection(addr, timeout=self._connect_timeout)
            except OSError as e:
                raise EncodeFailed(f"cannot connect to the tcp data port {addr[0]}:{addr[1]}: {e}") from e
            sock.setblocking(True)
            tune(sock, self._sock_buf, self._timeout)
            evicted = []
            with self._lock:
                conn = self._conns.setdefault(key, _Conn(sock))
                # Receivers come and go: keep at most max_conns idle-or-busy connections.
                while len(self._conns) > self._max_conns:
                    old_key = next((k for k, c in self._conns.items() if not c.lock.locked() and k != key), None)
                    if old_key is None:
                        break
                    evicted.append(self._conns.pop(old_key))
            for old in evicted:
                old.sock.close()
            if conn.sock is not sock:
                sock.close()
        return conn

    def _drop(self, addr: tuple[str, int], stream: int, conn: _Conn) -> None:
        with self._lock:
            if self._conns.get((addr, stream)) is conn:
                del self._conns[(addr, stream)]
        conn.sock.close()


def _stripes(pieces: list[Piece], total: int, n: int) -> list[list[Piece]]:
    """``pieces`` cut into ``n`` contiguous runs of about ``total / n`` bytes each."""
    target = -(-total // n)
    out: list[list[Piece]] = [[]]
    room = target
    for off, view in pieces:
        while view.nbytes:
            if room <= 0 and len(out) < n:
                out.append([])
                room = target
            take = view.nbytes if len(out) == n else min(view.nbytes, room)
            if take < view.nbytes:  # cut inside the tensor: round to a page multiple
                take = max(_CUT_ALIGN, (off + take) // _CUT_ALIGN * _CUT_ALIGN - off)
                take = min(take, view.nbytes)
            out[-1].append((off, view[:take]))
            off, view, room = off + take, view[take:], room - take
    return [s for s in out if s]


def _send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i:i + _IOV_MAX])
        while sent:
            n = bufs[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0


def _target(peer_info: dict[str, Any], dest: dict[str, Any]) -> tuple[tuple[str, int], bytes, int]:
    host, port = peer_info.get("data_host"), peer_info.get("data_port")
    token, span = dest.get("token"), dest.get("nbytes")
    if not (isinstance(host, str) and host and type(port) is int and 0 < port < 65536):
        raise EncodeFailed(f"the receiver's info names no tcp data port: {peer_info!r}")
    if not (isinstance(token, str) and type(span) is int and span >= 0):
        raise EncodeFailed(f"malformed tcp destination {dest!r}")
    try:
        raw = bytes.fromhex(token)
    except ValueError:
        raw = b""
    if len(raw) != 16 and span:
        raise EncodeFailed(f"malformed tcp destination token {token!r}")
    return (host, port), raw, span
