# SPDX-License-Identifier: Apache-2.0
"""``EmbeddingReceiver``: the prefill side of push delivery (docs/protocol.md).

One receiver binds one ZeroMQ ROUTER endpoint (the control channel) and owns
one data plane (its pre-allocated pool; the ``tcp`` plane also listens on a
data port of its own). Rooms are named by the prefill; ``delivery(room)`` gives
the JSON-able object to put in the encode request. Results come back either
blocking (``wait``) or poll-driven for an event loop (``expect`` / ``poll`` /
``ready_rooms`` / ``result``).

Contract:

* Every room ends in exactly one terminal state, ``done`` or ``failed``. A
  room is ``done`` only once the sender's ``Complete(ok)`` arrived (all TP
  ranks acknowledged); a failure carries the sender's code and reason, raised
  as the matching ``EncoderError`` subclass.
* ``result``/``wait`` (``copy=True``, the default) copy the tensors out of the
  pool (onto ``device``) and free the region at once, so the caller owns plain
  tensors. A ``done`` room is consumed by the first ``result``; a ``failed``
  one keeps answering with its error until its record ages out (``record_ttl``).
* Zero-copy (``copy=False``, CPU ``device`` only): the items' tensors are views
  into the pool region, which stays *held*: no sender writes it and no other
  room gets it until ``release(room)``. A held room counts against the pool
  (a full pool makes later Offers wait, then fail ``Overloaded``), never ages
  out, and keeps its name (``expect`` of it raises ``DuplicateRequest``).
  ``release`` is idempotent; after it the views may change under the caller.
  ``close()`` releases every held room (their views stay readable: they keep
  the memory alive). With a non-CPU ``device`` the move to the device is the
  copy: ``copy=False`` is ignored and the region freed at once.
* Offers for rooms not (yet) registered are accepted: a TP rank may learn of a
  room after the sender does. A ``Complete(failed)`` for an unknown room is
  kept (bounded by count and ``record_ttl``), so a later ``wait`` fails at once.
* Unclaimed ``done`` rooms hold their region until claimed or ``record_ttl``.
* Thread-safe. One I/O thread owns the socket and the room records; callers
  never block it for longer than a dict update. The ``tcp`` plane's own data
  threads write regions, the ``zmq`` plane's writes run on the I/O thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any, Sequence

import msgspec
import torch
import zmq

from epd_encoder.errors import (
    Cancelled,
    ConfigError,
    DuplicateRequest,
    EncoderError,
    NotFound,
    NotReady,
    Overloaded,
    RequestTimeout,
    SchemaError,
)
from epd_encoder.transfer import messages as m
from epd_encoder.transfer.base import Region, receiver_plane_factory
from epd_encoder.transfer.control import (
    Delivery,
    RecordBook,
    Target,
    Waker,
    bootstrap_seconds,
    check_delivery,
    error_for_code,
    room_name,
)
from epd_encoder.transfer.receiver_io import (
    _DTYPES,
    _LIVE,
    PollState,
    ReceivedItem,
    ReceiverIO,
    _Room,
    _same_items,
    _wire_item,
)
from epd_encoder.wire import ItemMeta


def _key(room: str | int) -> str:
    """The name a room is kept under (an int is its decimal string); lookups need no other check."""
    return room if isinstance(room, str) else room_name(room)


class EmbeddingReceiver(ReceiverIO):
    def __init__(self, backend: str = "tcp", *, host: str = "127.0.0.1", port: int = 0,
                 pool_bytes: int = 256 << 20, bootstrap_timeout: float = 10.0, record_ttl: float = 300.0,
                 tp_rank: int = 0, tp_size: int = 1, device: str | torch.device = "cpu",
                 transfer_timeout: float = 30.0, max_rooms: int = 4096, max_records: int = 4096,
                 advertise_host: str | None = None, **plane_options: Any) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"need 0 <= tp_rank < tp_size, got {tp_rank}, {tp_size}")
        self.backend, self.tp_rank, self.tp_size = backend, tp_rank, tp_size
        # The delivery carries it: a value the server would refuse is refused here, before any room.
        self.bootstrap_timeout, self.transfer_timeout = bootstrap_seconds(bootstrap_timeout), transfer_timeout
        self.pool_bytes, self.device, self.max_rooms = pool_bytes, torch.device(device), max_rooms
        factory = receiver_plane_factory(backend)
        if getattr(factory, "listens", False):  # the plane serves its own data port
            plane_options = {"host": host, "advertise_host": advertise_host, **plane_options}
        self.plane = factory(pool_bytes=pool_bytes, **plane_options)
        self._in_band = bool(getattr(self.plane, "in_band", False))
        self._lock = threading.Lock()
        self._live: dict[str, _Room] = {}
        self._finished: RecordBook[str, _Room] = RecordBook(record_ttl, max_records, on_evict=self._evicted)
        self._orphans: RecordBook[str, _Room] = RecordBook(record_ttl, min(max_records, 1024))
        # (room, sender) Offers refused for a room not live here: that sender's Complete for it
        # says nothing new, and must not leave a failed record (say, after a held room's release).
        self._refused: RecordBook[tuple[str, bytes], bool] = RecordBook(record_ttl, min(max_records, 1024))
        self._held: dict[str, Region] = {}  # rooms claimed with copy=False, until release()
        self._pool_waiters: deque[_Room] = deque()
        self._outbox: deque[tuple[bytes, m.Message]] = deque()
        self._pool_changed = False
        self._closed = False
        # late_complete: a Complete for a room not live here (one it never had, refused or ended).
        self.stats = {"malformed": 0, "dropped": 0, "refused_chunks": 0, "foreign_complete": 0,
                      "late_complete": 0}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A sender that reconnects under its identity takes over at once; without
        # this its first frames (an Offer) can be dropped as a duplicate identity.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, pool_bytes + (1 << 20))
        self._sock.setsockopt(zmq.LINGER, 200)
        try:
            self._sock.bind(f"tcp://{host}:{port or '*'}")
        except (zmq.ZMQError, ValueError) as e:
            self.plane.close()
            self._sock.close(0)
            self._ctx.term()
            raise ConfigError(f"cannot bind the receiver on {host}:{port}: {e}") from e
        bound_port = self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        self.endpoint = f"tcp://{advertise_host or host}:{bound_port}"
        self._waker = Waker()
        self._thread = threading.Thread(target=self._run, name=f"epd-rx-{bound_port}", daemon=True)
        self._thread.start()

    # -- public API ----------------------------------------------------------

    def target(self) -> dict[str, Any]:
        """This rank's entry of a delivery's ``targets`` (rank 0 collects the others' as ``peers``)."""
        return Target(self.endpoint, self.tp_rank, self.plane.info()).to_json()

    def delivery(self, room: str | int, *, peers: Sequence[dict] | None = None,
                 items: Sequence[m.WireItem | ItemMeta | dict] | None = None,
                 timeout: float | None = None) -> dict[str, Any]:
        """Register ``room`` (as ``expect``) and return the request's ``delivery`` object.

        ``peers`` are the other TP ranks' ``target()`` dicts: every rank gets a
        full copy of every tensor. An int ``room`` is sent as its decimal string.
        Raises ``TypeError`` / ``ValueError`` (registering nothing) for whatever
        the server would refuse: the check is the server's own, ``check_delivery``.
        A name whose room already ended here starts a new room: the old one's
        unclaimed result or failure is dropped (a held room raises ``DuplicateRequest``).
        """
        own = Delivery(self.backend, room_name(room), (), self.bootstrap_timeout).to_json()
        d = check_delivery({**own, "targets": [self.target(), *(peers or ())]})
        if self.tp_size > 1 and len(d.targets) != self.tp_size:
            raise ConfigError(f"tp_size is {self.tp_size} but the delivery names {len(d.targets)} ranks")
        with self._lock:
            self._forget_finished(d.room)
        self.expect(d.room, items=items, timeout=timeout)
        return replace(d, targets=tuple(sorted(d.targets, key=lambda t: t.rank))).to_json()

    def expect(self, room: str | int, *, items: Sequence[m.WireItem | ItemMeta | dict] | None = None,
               timeout: float | None = None) -> None:
        """Register ``room``; idempotent. ``items`` (from the encode response) are checked
        against the Offer; ``timeout`` (default ``record_ttl``) fails the room if it is not
        done by then. A name the server would refuse raises ``TypeError`` / ``ValueError``.
        """
        room = room_name(room)
        want = None if items is None else tuple(_wire_item(x) for x in items)
        with self._lock:
            self._check_open()
            r = self._find(room)
            if r is None:
                if room in self._held:
                    raise DuplicateRequest(f"room {room!r} is still held (result with copy=False); "
                                           "release it first")
                if len(self._live) >= self.max_rooms:
                    raise Overloaded(f"receiver holds {len(self._live)} live rooms")
                r = self._live[room] = _Room(room, time.monotonic())
            elif self._orphans.pop(room) is not None:
                self._finished.put(room, r)
            r.registered = True
            if r.state == "expecting":
                r.deadline = time.monotonic() + (self._finished.ttl if timeout is None else timeout)
            if want is not None:
                r.expected = want
                if r.offer is not None and r.state != "failed" and not _same_items(r.offer.items, want):
                    self._fail(r, SchemaError(f"room {room}: the offered items differ from the expected ones"),
                               abort="items differ from the expected ones")

    def poll(self, room: str | int) -> PollState:
        room = _key(room)
        with self._lock:
            r = self._find(room)
            if r is None:
                raise NotFound(f"room {room!r} is unknown, claimed or expired")
            return "pending" if r.state in _LIVE else r.state  # type: ignore[return-value]

    def ready_rooms(self) -> list[str]:
        """Registered (or data-holding) rooms that reached a terminal state and await ``result``."""
        with self._lock:
            return self._finished.keys()

    def result(self, room: str | int, *, copy: bool = True) -> list[ReceivedItem]:
        """The items of a ``done`` room (consumed); raises its error if ``failed``, ``NotReady`` if pending.

        ``copy=False`` on a CPU receiver returns views into the pool and holds
        the region until ``release(room)`` (see the class contract).
        """
        room, hold = _key(room), not copy and self.device.type == "cpu"
        with self._lock:
            r = self._find(room)
            if r is None:
                raise NotFound(f"room {room!r} is unknown, claimed or expired")
            if r.state in _LIVE:
                raise NotReady(f"room {room!r} is still {r.state}")
            if r.state == "failed":
                raise type(r.error)(str(r.error)) from r.error
            self._finished.pop(room)
            region, r.region = r.region, None
            if hold and region is not None and region.nbytes:
                self._held[room] = region
        try:
            return self._items(r, region, copy=not hold)
        finally:
            if not hold:
                self._free_claimed(region)

    def wait(self, room: str | int, timeout: float | None = 30.0, *, copy: bool = True) -> list[ReceivedItem]:
        """Block until ``room`` ends; on timeout fail it, send ``Abort`` and raise ``RequestTimeout``.

        ``copy`` as for ``result``.
        """
        room = _key(room)
        with self._lock:
            self._check_open()
            r = self._find(room)
        if r is None:
            self.expect(room)
            with self._lock:
                r = self._find(room)
        if r is not None and not r.event.wait(timeout):
            with self._lock:
                if r.state in _LIVE:
                    err = RequestTimeout(f"room {room!r} not delivered within {timeout}s")
                    self._fail(r, err, abort="receiver wait timed out")
            self._waker.wake()
        return self.result(room, copy=copy)

    def release(self, room: str | int) -> bool:
        """Free a room held by ``result(copy=False)``; ``False`` (a no-op) if it is not held."""
        room = _key(room)
        with self._lock:
            region = self._held.pop(room, None)
        if region is None:
            return False
        self._free_claimed(region)
        return True

    def held_rooms(self) -> list[str]:
        """Rooms claimed with ``copy=False`` and not yet released."""
        with self._lock:
            return list(self._held)

    def discard(self, room: str | int) -> None:
        """Forget ``room``: a live one is aborted, a done one's region freed unread, a held one released."""
        room = _key(room)
        if self.release(room):
            return
        with self._lock:
            r = self._find(room)
            if r is None:
                return
            if r.state in _LIVE:
                self._fail(r, Cancelled(f"room {room!r} discarded by the receiver"), abort="discarded")
            for book in (self._finished, self._orphans):
                if book.pop(room) is not None:
                    self._evicted(room, r)
        self._waker.wake()

    def close(self) -> None:
        """Abort every live room, stop the I/O thread, release the socket and the pool."""
        with self._lock:
            if self._closed:
                return
            for r in list(self._live.values()):
                self._fail(r, Cancelled("receiver closed"), abort="receiver closed")
            held, self._held = list(self._held.values()), {}
            for region in held:
                self.plane.free(region)
            self._closed = True
        self._waker.wake()
        self._thread.join(timeout=5.0)
        self._sock.close(linger=200)
        self._ctx.term()
        self._waker.close()
        self.plane.close()

    def __enter__(self) -> EmbeddingReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bookkeeping (lock held) ----------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise NotReady("receiver is closed")

    def _find(self, room: str) -> _Room | None:
        return self._live.get(room) or self._finished.get(room) or self._orphans.get(room)

    def _forget_finished(self, name: str) -> _Room | None:
        """Drop ``name``'s ended room (freeing an unclaimed region) so the name can start a new one."""
        r = self._finished.pop(name) or self._orphans.pop(name)
        if r is not None:
            self._evicted(name, r)
        return r

    def _evicted(self, name: str, r: _Room) -> None:
        if r.region is not None and r.region.nbytes:
            self.plane.free(r.region)
            self._pool_changed = True
        r.region = None

    def _finish(self, r: _Room) -> None:
        self._live.pop(r.name, None)
        if r.registered or r.state == "done" or r.offer is not None:
            self._finished.put(r.name, r)
        else:
            self._orphans.put(r.name, r)
        r.event.set()

    def _fail(self, r: _Room, err: EncoderError, *, abort: str = "") -> None:
        if r.state not in _LIVE:
            return
        r.state, r.error = "failed", err
        self._release(r)
        if abort and r.sender is not None:
            self._outbox.append((r.sender, m.Abort(room=r.name, reason=abort)))
        self._finish(r)

    def _release(self, r: _Room) -> None:
        # A region mid-write is freed by the I/O thread once its write returns.
        if r.region is not None and not r.writing:
            if r.region.nbytes:
                self.plane.free(r.region, failed=True)
            r.region = None
            self._pool_changed = True

    def _refuse(self, ident: bytes, r: _Room, reason: str, code: str) -> None:
        self._send(ident, m.Reject(room=r.name, reason=reason, code=code))
        self._settle(r, error_for_code(code, reason))

    def _settle(self, r: _Room, err: EncoderError) -> None:
        # Refused here: the sender's Complete(failed) carries the outcome every rank agrees on.
        self._release(r)
        r.state, r.local_error = "settling", err
        r.deadline = time.monotonic() + self.transfer_timeout

    def _free_claimed(self, region: Region | None) -> None:
        with self._lock:
            if region is not None and region.nbytes:
                self.plane.free(region)
            self._pool_changed = True
        self._waker.wake()

    def _items(self, r: _Room, region: Region | None, *, copy: bool) -> list[ReceivedItem]:
        assert r.offer is not None
        base = self.plane.view(region) if region is not None and region.nbytes else torch.empty(0, dtype=torch.uint8)
        cpu = self.device.type == "cpu"
        out = []
        for item, offs in zip(r.offer.items, r.offsets):
            ts = []
            for off, n in offs:
                t = base[off:off + n].view(_DTYPES[item.dtype]).reshape(item.num_tokens, item.hidden_size)
                ts.append(t if not copy else t.clone() if cpu else t.to(self.device))
            # JSON types, as the encode answer and the inline metadata give them.
            video = msgspec.json.decode(msgspec.json.encode(item.video)) if item.video is not None else None
            out.append(ReceivedItem(ts[0], ts[1:] if item.num_deepstack else None, item.key,
                                    item.num_tokens, tuple(item.grid_thw), item.modality, video))
        return out
