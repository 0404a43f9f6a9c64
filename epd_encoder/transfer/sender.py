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
* Peers are admitted when a room opens: ``open`` (and ``precheck``) raise
  ``Overloaded`` when the room's new endpoints would take more than
  ``max_peers`` peers, or more than ``max_peers - proven_slots`` peers whose
  endpoint never completed a handshake, so endpoints that never answer cannot
  crowd out receivers that do. A live room holds its peers; a peer retires once
  it holds none, at once unless its receiver has answered (its last Offer found
  no receiver, or its rooms ended before any Offer), else after ``peer_idle_s`` idle.
* A room is ``done`` when every target rank acknowledged its full copy; the
  sender then sends ``Complete(ok)`` to all of them. Any refusal, timeout
  (``bootstrap_timeout`` to Accept, ``transfer_timeout`` to Ack), Abort or
  write error fails it and sends one ``Complete(ok=False, code, reason)`` to all.
* Room names are scoped to their receivers: a live room holds its name on
  each of its target endpoints (where the wire names it), so two prefills may
  use the same name, but a receiver never has two live rooms of one name.
  ``status`` finds a room by its name and its rank-0 target's endpoint.
* Status records of finished rooms are kept ``record_ttl`` seconds, at most
  ``max_records`` of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import msgspec
import torch
import zmq

from epd_encoder.errors import (
    Cancelled,
    ConfigError,
    DuplicateRequest,
    EncoderError,
    NotReady,
    OutputMismatch,
    Overloaded,
    SchemaError,
)
from epd_encoder.transfer import messages as m
from epd_encoder.transfer.base import SenderPlane, sender_plane_factory
from epd_encoder.transfer.control import (
    Delivery,
    RecordBook,
    parse_delivery,
)
from epd_encoder.transfer.policy import TargetPolicy
from epd_encoder.transfer.sender_peer import _Peer
from epd_encoder.types import ItemOutput
from epd_encoder.wire import dtype_name

log = logging.getLogger(__name__)


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

    def keys(self) -> list[tuple[str, str]]:
        return [(t.endpoint, self.name) for t in self.delivery.targets]

    def status(self) -> dict[str, Any]:
        return {"room": self.name, "receiver": self.delivery.receiver, "request_id": self.request_id,
                "state": self.state, "code": self.code, "reason": self.reason, "opened": self.opened,
                "delivered": self.delivered, "finished": self.finished, "targets": len(self.delivery.targets)}


class PushObserver(Protocol):
    """What the sender reports as it works, for metrics (the runtime passes api/metrics.py's
    ``PushMetrics``; transfer/ stays free of Prometheus). Called on sender threads: must not block."""

    def room_ended(self, outcome: str, transfer_s: float | None) -> None:
        """A room ended: ``outcome`` is "done" or the error code; ``transfer_s`` is, for a done
        room, the seconds from its outputs being handed over to the last target's ack."""

    def bytes_sent(self, n: int) -> None:
        """``n`` bytes were written to one target (each target of a room counts)."""


class _NoObserver:
    def room_ended(self, outcome: str, transfer_s: float | None) -> None:
        pass

    def bytes_sent(self, n: int) -> None:
        pass


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
                 peer_idle_s: float = 60.0, plane_options: dict[str, dict[str, Any]] | None = None,
                 max_peers: int = 256, proven_slots: int = 64, allowed_targets: Sequence[str] | None = None,
                 observer: PushObserver | None = None) -> None:
        if not 0 <= proven_slots < max_peers:
            raise ConfigError(f"need 0 <= proven_slots < max_peers, got {proven_slots}, {max_peers}")
        self.sender_id = sender_id
        self.observer = observer if observer is not None else _NoObserver()
        self.policy = TargetPolicy(allowed_targets)
        self.max_peers = max_peers  # each peer is a thread and a socket: clients must not grow them unbounded
        self.proven_slots = proven_slots
        self.bootstrap_timeout, self.transfer_timeout = bootstrap_timeout, transfer_timeout
        self.max_queue_per_peer, self.peer_idle_s = max_queue_per_peer, peer_idle_s
        self._plane_options = plane_options or {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last live room ends
        self._live: dict[tuple[str, str], _Room] = {}  # (target endpoint, room) for every target
        self._records: RecordBook[tuple[str, str], dict] = RecordBook(record_ttl, max_records)
        self._peers: dict[str, _Peer] = {}
        self._refs: Counter[str] = Counter()  # live rooms naming each endpoint: they hold its peer
        self._proven: OrderedDict[str, None] = OrderedDict()  # endpoints that answered, newest last
        self._planes: dict[str, SenderPlane] = {}
        self._refusing = False
        self._ctx = zmq.Context()
        self._closed = False

    def open(self, delivery: dict, request_id: str, items: Sequence[m.WireItem], *,
             on_done: Callable[[dict], None] | None = None) -> RoomHandle:
        """Validate ``delivery`` (``SchemaError``) and record the room ``pending``."""
        d = parse_delivery(delivery)
        self.policy.check(d)
        try:
            wire = tuple(msgspec.convert(msgspec.to_builtins(list(items)), list[m.WireItem]))
        except msgspec.ValidationError as e:
            raise SchemaError(f"room {d.room}: malformed items: {e}") from e
        self._plane(d.backend)
        timeout = min(d.bootstrap_timeout or self.bootstrap_timeout, self.bootstrap_timeout)
        room = _Room(d.room, request_id, d, wire, timeout, on_done)
        with self._lock:
            if self._closed or self._refusing:
                raise NotReady("push sender is closed")
            taken = next((key for key in room.keys() if key in self._live), None)
            if taken is not None:
                raise DuplicateRequest(f"room {d.room!r} is already being delivered to {taken[0]}")
            for endpoint in self._admit(d):
                self._peer(endpoint)
            self._refs.update(t.endpoint for t in d.targets)
            self._live.update(dict.fromkeys(room.keys(), room))
        return RoomHandle(self, room)

    def precheck(self, delivery: dict) -> None:
        """``open``'s checks that need no outputs (schema, target policy, a peer slot), so a
        request that would be refused is refused before its preprocessing; reserves nothing."""
        d = parse_delivery(delivery)
        self.policy.check(d)
        with self._lock:
            if self._closed or self._refusing:
                raise NotReady("push sender is closed")
            self._admit(d)

    def _admit(self, d: Delivery) -> list[str]:
        """The endpoints of ``d`` that need a new peer; ``Overloaded`` if their slots cannot be had."""
        new = [t.endpoint for t in d.targets if t.endpoint not in self._peers]
        if not new:
            return new
        if len(self._peers) + len(new) > self.max_peers:
            raise Overloaded(f"push: {len(self._peers)} receivers are connected (max_peers={self.max_peers})")
        unproven_new = sum(e not in self._proven for e in new)
        unproven = unproven_new + sum(not p.proven for p in self._peers.values())
        if unproven_new and unproven > self.max_peers - self.proven_slots:
            raise Overloaded(f"push: too many receivers that never answered this server are connected "
                             f"({self.max_peers - self.proven_slots} slots; {self.proven_slots} more are "
                             f"kept for receivers that did)")
        return new

    def _proved(self, peer: _Peer) -> None:
        """``peer``'s receiver answered an Offer: it is proven, and stays known after the peer retires."""
        with self._lock:
            peer.proven, peer.unreachable = True, False
            self._proven[peer.endpoint] = None
            self._proven.move_to_end(peer.endpoint)
            while len(self._proven) > 4 * self.max_peers:
                self._proven.popitem(last=False)

    def _unreachable(self, peer: _Peer) -> None:
        """No receiver at ``peer`` accepted an Offer in time: it loses its proven mark and retires
        as soon as it holds no room."""
        with self._lock:
            peer.proven, peer.unreachable = False, True
            self._proven.pop(peer.endpoint, None)

    def status(self, room: str, receiver: str) -> dict[str, Any] | None:
        """``{"state": pending|sending|done|failed, "code", "reason", timestamps...}`` or ``None``.

        ``receiver`` is the endpoint of the room's rank-0 target; any other names no room.
        """
        with self._lock:
            live = self._live.get((receiver, room))
            if live is not None and live.delivery.receiver == receiver:
                return live.status()
            return self._records.get((receiver, room))

    def close(self, timeout: float = 0.0) -> None:
        """Refuse new rooms, give live rooms up to ``timeout`` seconds to end, then fail the rest
        (``Cancelled``), tell the receivers and stop the peer threads.

        A graceful stop passes its drain budget, so rooms already accepted still complete.
        """
        with self._lock:
            self._refusing = True  # open() refuses from here on: no room escapes the snapshot
            if self._live and timeout > 0:
                log.info("push: waiting up to %.1f s for %d open push rooms", timeout,
                         len(set(self._live.values())))
                self._idle.wait_for(lambda: not self._live, timeout)
            live = list(dict.fromkeys(self._live.values()))
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
            peer = self._peers[endpoint] = _Peer(self, endpoint, proven=endpoint in self._proven)
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
            if ok:  # the room's peers were admitted at open; only a crashed one is made again
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
        self._end(room, Overloaded(f"push queue is full: {full[0]} (max {self.max_queue_per_peer} rooms per peer)"))
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
                    # Telling a receiver that never had a channel costs a new peer: within the cap.
                    peer = self._peers.get(t.endpoint)
                    if peer is None and len(self._peers) < self.max_peers:
                        peer = self._peer(t.endpoint)
                    if peer is not None:
                        peer.post(("complete", room.name, done))
            for key in room.keys():
                self._live.pop(key, None)
            self._refs.subtract(t.endpoint for t in room.delivery.targets)
            for t in room.delivery.targets:
                if self._refs[t.endpoint] <= 0:
                    del self._refs[t.endpoint]
            if not self._live:
                self._idle.notify_all()
            status = room.status()
            self._records.put((room.delivery.receiver, room.name), status)
            release, room.release, room.chunks = room.release, None, []
        if release is not None:
            release()
        took = None if error is not None or room.delivered is None else room.finished - room.delivered
        self.observer.room_ended("done" if error is None else room.code, took)
        if room.on_done is not None:
            room.on_done(status)
