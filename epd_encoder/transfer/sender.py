# SPDX-License-Identifier: Apache-2.0
"""``PushSender``: the encode side of push delivery (docs/protocol.md).

Contract:

* ``open`` validates the request's ``delivery`` object and records the room
  ``pending``; ``RoomHandle.deliver`` and ``RoomHandle.fail`` never block the
  caller (the engine thread). Every room ends exactly once, ``done`` or
  ``failed``; ``release`` (the caller's pin on the tensors) runs exactly once,
  at that moment; ``on_done(status)`` too.
* Each peer endpoint gets one thread, one DEALER socket (identity =
  ``sender_id``) and a bound of ``max_queue_per_peer`` rooms in flight. A full
  bound fails the room at once with ``Overloaded``; a slow or dead receiver
  delays only the rooms sent to it.
* A room is ``done`` when every target rank acknowledged its full copy; the
  sender then sends ``Complete(ok)`` to all of them. Any refusal, timeout
  (``bootstrap_timeout`` to Accept, ``transfer_timeout`` to Ack), Abort or
  write error fails it and sends one ``Complete(ok=False, code, reason)`` to all.
* Status records of finished rooms are kept ``record_ttl`` seconds, at most
  ``max_records`` of them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import msgspec
import torch
import zmq

from epd_encoder.errors import (
    Cancelled,
    DuplicateRequest,
    EncoderError,
    NotReady,
    OutputMismatch,
    Overloaded,
    RequestTimeout,
    SchemaError,
)
from epd_encoder.transfer import messages as m
from epd_encoder.transfer.base import SenderPlane, sender_plane_factory
from epd_encoder.transfer.control import (
    Delivery,
    RecordBook,
    Target,
    Waker,
    error_for_code,
    parse_delivery,
)
from epd_encoder.types import ItemOutput
from epd_encoder.wire import dtype_name

_TICK_S = 0.05


@dataclass(eq=False)
class _Room:
    name: str
    request_id: str
    delivery: Delivery
    items: tuple[m.WireItem, ...]
    bootstrap_s: float
    on_done: Callable[[dict], None] | None
    state: str = "pending"
    code: str = ""
    reason: str = ""
    opened: float = field(default_factory=time.time)
    delivered: float | None = None
    finished: float | None = None
    chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    release: Callable[[], None] | None = None
    acked: set[int] = field(default_factory=set)

    def status(self) -> dict[str, Any]:
        return {"room": self.name, "request_id": self.request_id, "state": self.state, "code": self.code,
                "reason": self.reason, "opened": self.opened, "delivered": self.delivered,
                "finished": self.finished, "targets": len(self.delivery.targets)}


class RoomHandle:
    """One open room; ``deliver`` or ``fail`` it exactly once (later calls are no-ops)."""

    def __init__(self, sender: PushSender, room: _Room) -> None:
        self._sender, self._room = sender, room
        self.room = room.name

    def deliver(self, outputs: Sequence[ItemOutput], release: Callable[[], None]) -> None:
        """Ship ``outputs`` (one per item, matching the items' shapes and dtypes) without blocking."""
        self._sender._deliver(self._room, list(outputs), release)

    def fail(self, error: EncoderError) -> None:
        """End the room with ``error``; every target gets ``Complete(ok=False)``."""
        self._sender._end(self._room, error)

    @property
    def state(self) -> str:
        return self._room.state


def _chunks(items: Sequence[m.WireItem], outputs: Sequence[ItemOutput]) -> list[tuple[int, torch.Tensor]]:
    if len(outputs) != len(items):
        raise OutputMismatch(f"{len(outputs)} outputs for {len(items)} items")
    offsets, _ = m.layout(items)
    chunks = []
    for i, (item, out, offs) in enumerate(zip(items, outputs, offsets)):
        tensors = [out.embedding, *(out.deepstack or ())]
        if len(tensors) != 1 + item.num_deepstack:
            raise OutputMismatch(f"item {i}: {len(tensors) - 1} deepstack tensors, expected {item.num_deepstack}")
        for t, (off, _n) in zip(tensors, offs):
            if tuple(t.shape) != (item.num_tokens, item.hidden_size) or dtype_name(t.dtype) != item.dtype:
                raise OutputMismatch(f"item {i}: tensor {tuple(t.shape)} {t.dtype} disagrees with "
                                     f"[{item.num_tokens}, {item.hidden_size}] {item.dtype}")
            chunks.append((off, t))
    return chunks


class PushSender:
    def __init__(self, *, sender_id: str, bootstrap_timeout: float = 10.0, transfer_timeout: float = 30.0,
                 record_ttl: float = 300.0, max_queue_per_peer: int = 64, max_records: int = 4096,
                 peer_idle_s: float = 60.0, plane_options: dict[str, dict[str, Any]] | None = None) -> None:
        self.sender_id = sender_id
        self.bootstrap_timeout, self.transfer_timeout = bootstrap_timeout, transfer_timeout
        self.max_queue_per_peer, self.peer_idle_s = max_queue_per_peer, peer_idle_s
        self._plane_options = plane_options or {}
        self._lock = threading.Lock()
        self._live: dict[str, _Room] = {}
        self._records: RecordBook[dict] = RecordBook(record_ttl, max_records)
        self._peers: dict[str, _Peer] = {}
        self._planes: dict[str, SenderPlane] = {}
        self._ctx = zmq.Context()
        self._closed = False

    def open(self, delivery: dict, request_id: str, items: Sequence[m.WireItem], *,
             on_done: Callable[[dict], None] | None = None) -> RoomHandle:
        """Validate ``delivery`` (``SchemaError``) and record the room ``pending``."""
        d = parse_delivery(delivery)
        try:
            wire = tuple(msgspec.convert(msgspec.to_builtins(list(items)), list[m.WireItem]))
        except msgspec.ValidationError as e:
            raise SchemaError(f"room {d.room}: malformed items: {e}") from e
        self._plane(d.backend)
        timeout = min(d.bootstrap_timeout or self.bootstrap_timeout, self.bootstrap_timeout)
        room = _Room(d.room, request_id, d, wire, timeout, on_done)
        with self._lock:
            if self._closed:
                raise NotReady("push sender is closed")
            if d.room in self._live:
                raise DuplicateRequest(f"room {d.room!r} is already being delivered")
            self._live[d.room] = room
        return RoomHandle(self, room)

    def status(self, room: str) -> dict[str, Any] | None:
        """``{"state": pending|sending|done|failed, "code", "reason", timestamps...}`` or ``None``."""
        with self._lock:
            live = self._live.get(room)
            return live.status() if live is not None else self._records.get(room)

    def close(self) -> None:
        """Fail every live room (``Cancelled``), tell the receivers, stop the peer threads."""
        with self._lock:
            live = list(self._live.values())
        for room in live:
            self._end(room, Cancelled("push sender closed"))
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            for p in peers:
                p.post(("stop",))
        for p in peers:
            p.thread.join(timeout=5.0)
        for plane in self._planes.values():
            plane.close()
        self._ctx.term()

    # -- room transitions --------------------------------------------------------

    def _plane(self, backend: str) -> SenderPlane:
        with self._lock:
            plane = self._planes.get(backend)
        if plane is None:
            try:
                factory = sender_plane_factory(backend)
                options = dict(self._plane_options.get(backend, {}))
                if getattr(factory, "takes_timeout", False):
                    options.setdefault("timeout", self.transfer_timeout)
                plane = factory(**options)
            except Exception as e:  # an optional backend's import or set-up failed
                raise SchemaError(f"push backend {backend!r} is not available on this server: {e}") from e
            with self._lock:
                plane = self._planes.setdefault(backend, plane)
        return plane

    def _peer(self, endpoint: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is None:
            peer = self._peers[endpoint] = _Peer(self, endpoint)
        return peer

    def _deliver(self, room: _Room, outputs: list[ItemOutput], release: Callable[[], None]) -> None:
        try:
            chunks = _chunks(room.items, outputs)
        except EncoderError as e:
            self._end(room, e)
            release()
            return
        with self._lock:
            ok = room.state == "pending" and not self._closed
            if ok:
                peers = [self._peer(t.endpoint) for t in room.delivery.targets]
                full = [p.endpoint for p in peers if p.load >= self.max_queue_per_peer]
                if not full:
                    room.state, room.delivered = "sending", time.time()
                    room.chunks, room.release = chunks, release
                    for p, t in zip(peers, room.delivery.targets):
                        p.load += 1
                        p.post(("start", room, t))
                    return
        if not ok:
            release()  # already ended (failed before its outputs were ready): nothing to send
            return
        self._end(room, Overloaded(f"push queue to {full[0]} is full ({self.max_queue_per_peer} rooms)"))
        release()

    def _acked(self, room: _Room, rank: int) -> None:
        with self._lock:
            room.acked.add(rank)
            all_acked = room.state == "sending" and len(room.acked) == len(room.delivery.targets)
        if all_acked:
            self._end(room, None)

    def _end(self, room: _Room, error: EncoderError | None) -> None:
        with self._lock:
            if room.state in ("done", "failed"):
                return
            room.state, room.finished = ("done", time.time()) if error is None else ("failed", time.time())
            if error is not None:
                room.code, room.reason = error.code, str(error)
            done = m.Complete(room=room.name, ok=error is None, code=room.code, reason=room.reason)
            if not self._closed:
                for t in room.delivery.targets:
                    self._peer(t.endpoint).post(("complete", room.name, done))
            self._live.pop(room.name, None)
            status = room.status()
            self._records.put(room.name, status)
            release, room.release, room.chunks = room.release, None, []
        if release is not None:
            release()
        if room.on_done is not None:
            room.on_done(status)


@dataclass(eq=False)
class _Part:
    room: _Room
    target: Target
    state: str
    deadline: float | None


class _Peer:
    """One receiver endpoint: its thread, its DEALER socket and its rooms in flight."""

    def __init__(self, sender: PushSender, endpoint: str) -> None:
        self.sender, self.endpoint = sender, endpoint
        self.load = 0  # rooms started here and not yet completed; guarded by the sender's lock
        self._inbox: deque[tuple] = deque()
        self._waker = Waker()
        self._parts: dict[str, _Part] = {}
        self.thread = threading.Thread(target=self._run, name=f"epd-tx-{endpoint}", daemon=True)
        self.thread.start()

    def post(self, cmd: tuple) -> None:
        self._inbox.append(cmd)
        self._waker.wake()

    def _run(self) -> None:
        s = self.sender
        sock = s._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, s.sender_id.encode())
        sock.setsockopt(zmq.SNDTIMEO, int(s.transfer_timeout * 1000))
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        idle_since = time.monotonic()
        try:
            while True:
                events = dict(poller.poll(int(_TICK_S * 1000)))
                self._waker.drain()
                while self._inbox:
                    if not self._command(sock, self._inbox.popleft()):
                        return
                if events.get(sock):
                    for _ in range(256):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._message(sock, frames)
                now = time.monotonic()
                self._expire(now)
                if self._parts or self._inbox:
                    idle_since = now
                elif now - idle_since > s.peer_idle_s and self._retire():
                    return
        finally:
            sock.close(linger=200)
            self._waker.close()

    def _retire(self) -> bool:
        with self.sender._lock:
            if self.load or self._inbox or self.sender._peers.get(self.endpoint) is not self:
                return False
            del self.sender._peers[self.endpoint]
            return True

    def _send(self, sock: zmq.Socket, msg: m.Message) -> bool:
        try:
            sock.send(m.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def _command(self, sock: zmq.Socket, cmd: tuple) -> bool:
        if cmd[0] == "stop":
            return False
        if cmd[0] == "complete":
            self._send(sock, cmd[2])
            self._drop(cmd[1])
            return True
        room, target = cmd[1], cmd[2]
        if room.state != "sending":
            self._unload()
            return True
        self._parts[room.name] = _Part(room, target, "offered", time.monotonic() + room.bootstrap_s)
        offer = m.Offer(room=room.name, request_id=room.request_id, sender=self.sender.sender_id,
                        items=room.items, total_bytes=m.layout(room.items)[1])
        if not self._send(sock, offer):
            self.sender._end(room, Overloaded(f"control channel to {self.endpoint} is backed up"))
        return True

    def _drop(self, name: str) -> None:
        if self._parts.pop(name, None) is not None:
            self._unload()

    def _unload(self) -> None:
        with self.sender._lock:
            self.load -= 1

    def _message(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        try:
            msg = m.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        part = self._parts.get(msg.room)
        if part is None or part.room.state != "sending":
            return
        room, rank = part.room, part.target.rank
        if isinstance(msg, m.Accept) and part.state == "offered":
            self._write(sock, part, msg.dest)
        elif isinstance(msg, m.Reject):
            self.sender._end(room, error_for_code(msg.code, f"rank {rank} refused room {room.name}: {msg.reason}"))
        elif isinstance(msg, m.Ack) and part.state == "written":
            if msg.ok:
                part.state, part.deadline = "acked", None
                self.sender._acked(room, rank)
            else:
                self.sender._end(room, error_for_code(msg.code, f"rank {rank} rejected the bytes of room "
                                                                f"{room.name}: {msg.reason}"))
        elif isinstance(msg, m.Abort):
            self.sender._end(room, Cancelled(f"rank {rank} aborted room {room.name}: {msg.reason}"))

    def _write(self, sock: zmq.Socket, part: _Part, dest: dict[str, Any]) -> None:
        room = part.room
        plane = self.sender._plane(room.delivery.backend)
        try:
            plane.write(part.target.info, {**dest, "room": room.name}, room.chunks,
                        lambda frames: sock.send_multipart(frames, copy=False))
        except Exception as e:
            if isinstance(e, EncoderError):
                err = e
            elif isinstance(e, zmq.Again):
                err = RequestTimeout(f"rank {part.target.rank} stopped reading room {room.name}")
            else:
                err = EncoderError(f"writing room {room.name} failed: {e}")
            err.__cause__ = None if err is e else e
            self.sender._end(room, err)
            return
        part.state, part.deadline = "written", time.monotonic() + self.sender.transfer_timeout
        self._send(sock, m.Written(room=room.name, total_bytes=m.layout(room.items)[1]))

    def _expire(self, now: float) -> None:
        for part in [p for p in self._parts.values() if p.deadline is not None and p.deadline <= now]:
            room, rank = part.room, part.target.rank
            if part.state == "offered":
                err = RequestTimeout(f"no receiver at {self.endpoint} (rank {rank}) accepted room "
                                     f"{room.name} within {room.bootstrap_s}s")
            else:
                err = RequestTimeout(f"rank {rank} did not acknowledge room {room.name} within "
                                     f"{self.sender.transfer_timeout}s")
            part.deadline = None
            self.sender._end(room, err)
