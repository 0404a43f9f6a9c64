# SPDX-License-Identifier: Apache-2.0
"""One receiver endpoint of the push sender: its thread, DEALER socket and rooms in flight.

A peer's thread owns its socket; a slow or dead receiver only delays the rooms
queued on its own peer. It reports back to the ``PushSender`` through
``_end``, ``_acked``, ``_proved``, ``_unreachable`` and ``_plane`` under the
sender's lock. It retires when no live room names its endpoint: at once unless
its receiver has answered (an Offer found none, or none was ever offered), else
after ``peer_idle_s`` idle.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from epd_encoder.errors import (
    Cancelled,
    EncoderError,
    Overloaded,
    RequestTimeout,
)
from epd_encoder.transfer import messages as m
from epd_encoder.transfer.control import (
    Target,
    Waker,
    error_for_code,
)

if TYPE_CHECKING:  # the sender imports this module; types only
    from epd_encoder.transfer.sender import PushSender, _Room

_TICK_S = 0.05
_ANSWERS = (m.Accept, m.Reject, m.Ack, m.Abort)  # only a receiver sends these (a self-connect echoes Offers)


@dataclass(eq=False)
class _Part:
    room: _Room
    target: Target
    state: str
    deadline: float | None


class _Peer:
    """One receiver endpoint: its thread, its DEALER socket and its rooms in flight."""

    def __init__(self, sender: PushSender, endpoint: str, *, proven: bool = False) -> None:
        self.sender, self.endpoint = sender, endpoint
        self.load = 0  # rooms started here and not yet completed; guarded by the sender's lock
        self.proven = proven  # its receiver answered an Offer (now or before); sender's lock
        self.unreachable = False  # an Offer here found no receiver, none has answered since
        self._inbox: deque[tuple] = deque()
        self._waker = Waker()
        self._parts: dict[str, _Part] = {}
        self.thread = threading.Thread(target=self._run, name=f"epd-tx-{endpoint}", daemon=True)
        self.thread.start()

    def post(self, cmd: tuple) -> None:
        self._inbox.append(cmd)
        self._waker.wake()

    def _run(self) -> None:
        s, sock = self.sender, None
        try:
            sock = s._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, s.sender_id.encode())
            sock.setsockopt(zmq.SNDTIMEO, int(s.transfer_timeout * 1000))
            sock.connect(self.endpoint)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(self._waker.fileno(), zmq.POLLIN)
            idle_since = time.monotonic()
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
                elif (self.unreachable or not self.proven or now - idle_since > s.peer_idle_s) \
                        and self._retire():  # idle is kept only for a receiver that answered
                    return
        except Exception as e:  # never strand rooms: fail this peer's rooms and forget the peer
            self._crash(e)
        finally:
            if sock is not None:
                sock.close(linger=200)
            self._waker.close()

    def _crash(self, e: Exception) -> None:
        s = self.sender
        with s._lock:
            if s._peers.get(self.endpoint) is self:
                del s._peers[self.endpoint]
        err = EncoderError(f"push channel to {self.endpoint} failed: {e!r}")
        rooms = [p.room for p in self._parts.values()]
        rooms += [cmd[1] for cmd in self._inbox if cmd[0] == "start"]
        for room in rooms:
            s._end(room, err)

    def _retire(self) -> bool:
        with self.sender._lock:
            if self.load or self._inbox or self.sender._refs.get(self.endpoint) \
                    or self.sender._peers.get(self.endpoint) is not self:
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
        if part is None:
            return
        if isinstance(msg, _ANSWERS) and (not self.proven or self.unreachable):
            self.sender._proved(self)  # a receiver speaking the protocol answered
        if part.room.state != "sending":
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
        total = m.layout(room.items)[1]
        self.sender.observer.bytes_sent(total)
        self._send(sock, m.Written(room=room.name, total_bytes=total))

    def _expire(self, now: float) -> None:
        for part in [p for p in self._parts.values() if p.deadline is not None and p.deadline <= now]:
            room, rank = part.room, part.target.rank
            if part.state == "offered":
                self.sender._unreachable(self)
                err = RequestTimeout(f"no receiver at {self.endpoint} (rank {rank}) accepted room "
                                     f"{room.name} within {room.bootstrap_s}s")
            else:
                err = RequestTimeout(f"rank {rank} did not acknowledge room {room.name} within "
                                     f"{self.sender.transfer_timeout}s")
            part.deadline = None
            self.sender._end(room, err)
