# SPDX-License-Identifier: Apache-2.0
"""The receiver's protocol side: room records and the I/O-thread message handlers.

``ReceiverIO`` is the half of ``EmbeddingReceiver`` that only its I/O thread
runs (socket, Offer/Data/Written/Complete handling, expiry); the public API
half lives in ``transfer/receiver.py``. Both share the ``_Room`` records under
the receiver's lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Literal, Sequence

import msgspec
import torch
import zmq

from epd_encoder.errors import (
    Cancelled,
    EncoderError,
    Overloaded,
    RequestTimeout,
    SchemaError,
)
from epd_encoder.transfer import messages as m
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.control import (
    error_for_code,
)
from epd_encoder.wire import ItemMeta

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TICK_S = 0.05
_LIVE = ("expecting", "waiting_pool", "receiving", "acked", "settling")
PollState = Literal["pending", "done", "failed"]


@dataclass(frozen=True)
class ReceivedItem:
    embedding: torch.Tensor
    deepstack: list[torch.Tensor] | None
    key: str
    num_tokens: int
    grid_thw: tuple[int, int, int]
    modality: str = "image"
    video: dict | None = None  # frames_indices, fps, second_per_grid_ts / timestamps


class _Room:
    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.state = "expecting"
        self.registered = False
        self.expected: tuple[m.WireItem, ...] | None = None
        self.sender: bytes | None = None
        self.offer: m.Offer | None = None
        self.offsets: list[list[tuple[int, int]]] = []
        self.total = 0
        self.pending: set[tuple[int, int]] = set()
        self.region: Region | None = None
        self.writing = False
        self.bad = ""
        self.local_error: EncoderError | None = None
        self.error: EncoderError | None = None
        self.deadline: float | None = None
        self.created = now
        self.event = threading.Event()


def _wire_item(x: m.WireItem | ItemMeta | dict) -> m.WireItem:
    if isinstance(x, m.WireItem):
        return x
    d = x.to_json() if isinstance(x, ItemMeta) else x
    try:
        return msgspec.convert({f: d[f] for f in m.WireItem.__struct_fields__ if f in d}, m.WireItem)
    except (msgspec.ValidationError, TypeError) as e:
        raise SchemaError(f"cannot expect item {x!r}: {e}") from e


def _another_request(ended: _Room, ident: bytes, o: m.Offer) -> bool:
    """Whether Offer ``o`` is a new request reusing the name of ``ended``, not a late one of its own.

    A sender offers a room once, so an Offer after the room's own Offer, or after its sender's
    Complete (a failure before any Offer), is new unless it repeats that request. A room that
    failed here before any Offer (expect or wait timeout) refuses it: it is likely that
    request's late Offer.
    """
    if ended.offer is not None:
        return (ident, o.request_id) != (ended.sender, ended.offer.request_id)
    return ended.sender is not None


def _same_items(a: Sequence[m.WireItem], b: Sequence[m.WireItem]) -> bool:
    strip = lambda it: (it.key, it.num_tokens, tuple(it.grid_thw), it.hidden_size, it.dtype, it.num_deepstack)
    return len(a) == len(b) and all(strip(x) == strip(y) for x, y in zip(a, b))


class ReceiverIO:
    """Mixin: the handlers run by ``EmbeddingReceiver``'s I/O thread."""

    # -- the I/O thread ----------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        next_tick = 0.0
        while True:
            events = dict(poller.poll(int(_TICK_S * 1000)))
            if self._waker.fileno() in events:
                self._waker.drain()
            with self._lock:
                self._flush()
                if self._closed:
                    return
            if events.get(self._sock):
                for _ in range(256):
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            now = time.monotonic()
            with self._lock:
                if self._pool_changed:
                    self._pool_changed = False
                    self._retry_waiters()
                if now >= next_tick:
                    next_tick = now + _TICK_S
                    self._retry_waiters()  # a plane may free a region on its own thread (tcp)
                    self._expire(now)
                self._flush()

    def _send(self, ident: bytes, msg: m.Message) -> None:
        self._outbox.append((ident, msg))

    def _flush(self) -> None:
        while self._outbox:
            ident, msg = self._outbox.popleft()
            try:
                self._sock.send_multipart([ident, m.encode(msg)], zmq.NOBLOCK)
            except zmq.ZMQError:
                self.stats["dropped"] += 1  # peer gone or backed up: its own timeout settles the room

    def _handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self.stats["malformed"] += 1
            return
        ident = frames[0].bytes
        try:
            msg = m.decode(frames[1].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats["malformed"] += 1
            return
        if isinstance(msg, m.Data):
            self._on_data(ident, msg, frames[2:])
            return
        with self._lock:
            if isinstance(msg, m.Offer):
                self._on_offer(ident, msg)
            elif isinstance(msg, m.Written):
                self._on_written(ident, msg)
            elif isinstance(msg, m.Complete):
                self._on_complete(ident, msg)
            else:
                self.stats["malformed"] += 1

    def _on_offer(self, ident: bytes, o: m.Offer) -> None:
        r = self._live.get(o.room)
        if r is None:
            ended = self._finished.get(o.room) or self._orphans.get(o.room)
            if self._closed or o.room in self._held or (ended is not None and not _another_request(ended, ident, o)):
                self._refused.put((o.room, ident), True)
                self._send(ident, m.Reject(room=o.room, reason="room already ended here", code=Cancelled.code))
                return
            if len(self._live) >= self.max_rooms:
                self._refused.put((o.room, ident), True)
                self._send(ident, m.Reject(room=o.room, reason="receiver holds too many rooms",
                                           code=Overloaded.code))
                return
            r = self._live[o.room] = _Room(o.room, time.monotonic())
            if ended is not None:  # a new request reusing the name: it replaces the ended room
                self._forget_finished(o.room)
                r.registered = ended.registered
        elif r.offer is not None:
            if r.sender != ident or r.offer != o:
                self._send(ident, m.Reject(room=o.room, reason="room already offered", code=SchemaError.code))
            return
        r.sender, r.offer = ident, o
        r.offsets, total = m.layout(o.items)
        r.total = total
        if total != o.total_bytes:
            self._refuse(ident, r, f"offer says {o.total_bytes} B but its items need {total} B", SchemaError.code)
        elif r.expected is not None and not _same_items(o.items, r.expected):
            self._refuse(ident, r, "offered items differ from the expected ones", SchemaError.code)
        elif total > self.pool_bytes:
            self._refuse(ident, r, f"room needs {total} B, the receive pool holds {self.pool_bytes} B",
                         Overloaded.code)
        elif not self._try_accept(r):
            # Half the window: the precise Reject(overloaded) must beat the sender's bootstrap timeout.
            r.state = "waiting_pool"
            r.deadline = time.monotonic() + self.bootstrap_timeout / 2
            self._pool_waiters.append(r)

    def _try_accept(self, r: _Room) -> bool:
        total = r.total
        try:
            r.region = self.plane.allocate(total) if total else Region(0, 0)
        except Overloaded:
            return False
        r.state, r.deadline = "receiving", time.monotonic() + self.transfer_timeout
        r.pending = {c for offs in r.offsets for c in offs if c[1]} if self._in_band else set()
        self._send(r.sender, m.Accept(room=r.name, dest=self.plane.destination(r.region)))
        return True

    def _retry_waiters(self) -> None:
        while self._pool_waiters:
            r = self._pool_waiters[0]
            if r.state != "waiting_pool":
                self._pool_waiters.popleft()
            elif self._try_accept(r):
                self._pool_waiters.popleft()
            else:
                return

    def _on_data(self, ident: bytes, d: m.Data, payload: list[zmq.Frame]) -> None:
        with self._lock:
            r = self._live.get(d.room)
            if r is None or r.state != "receiving" or r.sender != ident:
                self.stats["refused_chunks"] += 1
                return
            chunk = (d.offset, d.nbytes)
            if not self._in_band or len(payload) != 1 or chunk not in r.pending \
                    or payload[0].buffer.nbytes != d.nbytes:
                r.bad = r.bad or f"refused data frame of {d.nbytes} B at {d.offset}: not in the offered layout"
                self.stats["refused_chunks"] += 1
                return
            r.pending.discard(chunk)
            r.writing, region = True, r.region
        try:
            self.plane.write_frame(region, d.offset, payload[0].buffer)
        except EncoderError as e:
            r.bad = r.bad or f"write failed: {e}"
        finally:
            with self._lock:
                r.writing = False
                if r.state not in ("receiving", "acked"):
                    self._release(r)

    def _on_written(self, ident: bytes, w: m.Written) -> None:
        r = self._live.get(w.room)
        if r is None or r.state != "receiving" or r.sender != ident:
            return
        total = r.total
        reason = r.bad or (f"{len(r.pending)} tensors never arrived" if r.pending else "") \
            or (f"sender wrote {w.total_bytes} B, the room holds {total} B" if w.total_bytes != total else "") \
            or self.plane.settle(r.region, [c for offs in r.offsets for c in offs if c[1]])
        if reason:
            self._send(ident, m.Ack(room=r.name, ok=False, reason=reason, code=SchemaError.code))
            self._settle(r, SchemaError(reason))
        else:
            self._send(ident, m.Ack(room=r.name, ok=True))
            r.state, r.deadline = "acked", time.monotonic() + self.transfer_timeout

    def _on_complete(self, ident: bytes, c: m.Complete) -> None:
        r = self._live.get(c.room)
        if r is not None and r.sender is not None and ident != r.sender:
            # Another sender (a retry or a hedged request that was rejected) has no say
            # over a room the first sender is delivering.
            self.stats["foreign_complete"] += 1
            return
        if r is None:
            self.stats["late_complete"] += 1
            if self._refused.pop((c.room, ident)) is not None:
                return  # the end of an Offer this receiver refused: nothing to record
            if self._finished.get(c.room) is None and self._orphans.get(c.room) is None \
                    and c.room not in self._held:
                orphan = _Room(c.room, time.monotonic())
                orphan.state, orphan.sender = "failed", ident
                orphan.error = (error_for_code(c.code, c.reason) if not c.ok
                                else EncoderError("sender completed a room this receiver never received"))
                orphan.event.set()
                self._orphans.put(c.room, orphan)
            return
        if c.ok and r.state == "acked":
            r.state = "done"
            self._finish(r)
        elif c.ok:
            self._fail(r, r.local_error or EncoderError(f"sender completed room {r.name} while it was {r.state}"))
        else:
            self._fail(r, error_for_code(c.code, c.reason or "delivery failed"))

    def _expire(self, now: float) -> None:
        for r in [r for r in self._live.values() if r.deadline is not None and r.deadline <= now]:
            if r.state == "waiting_pool":
                reason = f"receive pool had no room for {r.total} B within {self.bootstrap_timeout / 2}s"
                self._refuse(r.sender, r, reason, Overloaded.code)
            elif r.state == "settling":
                self._fail(r, r.local_error or RequestTimeout("no outcome from the sender"))
            else:
                self._fail(r, RequestTimeout(f"room {r.name!r} timed out while {r.state}"),
                           abort=f"receiver timed out while {r.state}")
        self._finished.prune()
        self._orphans.prune()
        self._refused.prune()
