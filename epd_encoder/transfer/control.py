# SPDX-License-Identifier: Apache-2.0
"""Pieces of the push control plane shared by the sender and the receiver.

* ``Delivery`` / ``check_delivery``: the ``delivery`` object of a push encode
  request (docs/protocol.md) and its one validator, shared by the receiver that
  builds it, the HTTP schema and the sender, so that no delivery the receiver
  hands out is refused by the server. ``parse_delivery`` is the sender's form.
* ``RecordBook``: finished-room records bounded by age and count, so neither
  side's memory grows with the number of rooms it has ever seen.
* ``error_for_code``: the ``EncoderError`` class a wire ``code`` stands for.
* ``Waker``: wakes a thread blocked in ``zmq.Poller.poll`` from another thread.
"""

from __future__ import annotations

import operator
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, TypeVar
from urllib.parse import urlsplit

from epd_encoder.errors import EncoderError, SchemaError, clip, error_class
from epd_encoder.transfer.base import backends

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


# -- delivery ------------------------------------------------------------------------

MAX_ROOM_CHARS = 128
MAX_TARGETS = 64
MAX_BOOTSTRAP_S = 600.0
_ROOM = re.compile(r"[A-Za-z0-9._:\-]{1,%d}" % MAX_ROOM_CHARS)


@dataclass(frozen=True)
class Target:
    """One receiver of a room: a prefill rank's endpoint and its data plane's ``info()``."""

    endpoint: str
    rank: int
    info: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "rank": self.rank, "info": dict(self.info)}


@dataclass(frozen=True)
class Delivery:
    backend: str
    room: str
    targets: tuple[Target, ...]
    bootstrap_timeout: float | None

    @property
    def receiver(self) -> str:
        """The endpoint of the rank-0 target: the receiver that named the room and scopes its name."""
        return min(self.targets, key=lambda t: t.rank).endpoint

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": "push", "backend": self.backend, "room": self.room,
                             "targets": [t.to_json() for t in self.targets]}
        if self.bootstrap_timeout is not None:
            d["bootstrap_timeout"] = self.bootstrap_timeout
        return d


def room_name(value: object) -> str:
    """The room as the wire carries it: an int (SGLang-style 64-bit bootstrap rooms) becomes its
    decimal string. ``TypeError`` / ``ValueError`` for anything else the server refuses."""
    if isinstance(value, bool) or not (isinstance(value, str) or hasattr(value, "__index__")):
        raise TypeError(f"delivery.room must be a str or an int, got {type(value).__name__}")
    name = value if isinstance(value, str) else str(operator.index(value))
    if not _ROOM.fullmatch(name):
        raise ValueError(f"delivery.room must be 1-{MAX_ROOM_CHARS} chars of [A-Za-z0-9._:-], "
                         f"got {name[:MAX_ROOM_CHARS + 1]!r}")
    return name


def bootstrap_seconds(value: object) -> float:
    """A delivery's ``bootstrap_timeout``: a number of seconds in (0, ``MAX_BOOTSTRAP_S``]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"delivery.bootstrap_timeout must be a number, got {type(value).__name__}")
    if not 0 < value <= MAX_BOOTSTRAP_S:  # also refuses nan and inf
        raise ValueError(f"delivery.bootstrap_timeout must be in (0, {MAX_BOOTSTRAP_S:g}] s, got {value!r}")
    return float(value)


def _endpoint(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where}.endpoint must be a string")
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    try:
        parts = urlsplit(value)
        ok = parts.scheme == "tcp" and bool(parts.hostname) and parts.port is not None \
            and not (parts.path or parts.query or parts.fragment or parts.username)
    except ValueError:  # a port that is not a number in range
        ok = False
    if not ok:
        raise ValueError(f"{where}.endpoint must be tcp://host:port or ipc://path, got {clip(value, 80)}")
    return value


def _target(raw: Any, i: int) -> Target:
    where = f"delivery.targets[{i}]"
    if not isinstance(raw, dict):
        raise TypeError(f"{where} must be an object")
    endpoint, rank, info = _endpoint(raw.get("endpoint"), where), raw.get("rank", 0), raw.get("info", {})
    if type(rank) is not int:
        raise TypeError(f"{where}.rank must be an int")
    if rank < 0:
        raise ValueError(f"{where}.rank must be >= 0")
    if not isinstance(info, dict):
        raise TypeError(f"{where}.info must be an object")
    return Target(endpoint, rank, info)


def check_delivery(raw: Any) -> Delivery:
    """Validate a push ``delivery`` object: the one rule the receiver, the HTTP schema and the
    sender all apply. ``TypeError`` / ``ValueError`` name the first bad field."""
    if not isinstance(raw, dict):
        raise TypeError("delivery must be an object")
    if raw.get("mode") != "push":
        raise ValueError(f"delivery.mode must be 'push', got {clip(raw.get('mode'))}")
    backend = raw.get("backend")
    if backend not in backends():
        raise ValueError(f"delivery.backend must be one of {list(backends())}, got {clip(backend)}")
    room = room_name(raw.get("room"))
    targets = raw.get("targets")
    if not isinstance(targets, list):
        raise TypeError("delivery.targets must be a list")
    if not 1 <= len(targets) <= MAX_TARGETS:
        raise ValueError(f"delivery.targets must hold 1-{MAX_TARGETS} targets")
    parsed = tuple(_target(t, i) for i, t in enumerate(targets))
    if len({t.endpoint for t in parsed}) != len(parsed) or len({t.rank for t in parsed}) != len(parsed):
        raise ValueError("delivery.targets must not repeat an endpoint or a rank")
    timeout = raw.get("bootstrap_timeout")
    return Delivery(backend, room, parsed, None if timeout is None else bootstrap_seconds(timeout))


def parse_delivery(raw: Any) -> Delivery:
    """``check_delivery`` for the sender: ``SchemaError`` (422) names the first bad field."""
    try:
        return check_delivery(raw)
    except (TypeError, ValueError) as e:
        raise SchemaError(str(e)) from e


# -- errors --------------------------------------------------------------------------


def error_for_code(code: str, reason: str) -> EncoderError:
    """``reason`` as the ``EncoderError`` subclass whose ``code`` matches (the base for unknown codes)."""
    return error_class(code)(reason)


# -- bounded records -----------------------------------------------------------------


class RecordBook(Generic[K, V]):
    """``key -> value`` kept for at most ``ttl`` seconds and ``max_count`` entries, oldest out first.

    ``on_evict(key, value)`` runs for every entry that ages or is crowded out,
    so the owner can free what it holds. Not thread-safe: the owner serializes
    access (and ``on_evict`` runs under the owner's lock).
    """

    def __init__(self, ttl: float, max_count: int, *, clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[K, V], None] | None = None) -> None:
        if ttl <= 0 or max_count < 1:
            raise ValueError(f"need ttl > 0 and max_count >= 1, got {ttl}, {max_count}")
        self.ttl, self.max_count = ttl, max_count
        self._clock = clock
        self._on_evict = on_evict
        self._items: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def put(self, key: K, value: V) -> None:
        self._items.pop(key, None)
        self._items[key] = (self._clock(), value)
        self.prune()

    def get(self, key: K) -> V | None:
        self.prune()
        entry = self._items.get(key)
        return None if entry is None else entry[1]

    def pop(self, key: K) -> V | None:
        entry = self._items.pop(key, None)
        return None if entry is None else entry[1]

    def prune(self) -> None:
        cutoff = self._clock() - self.ttl
        while self._items:
            key, (t, value) = next(iter(self._items.items()))
            if t > cutoff and len(self._items) <= self.max_count:
                break
            del self._items[key]
            if self._on_evict is not None:
                self._on_evict(key, value)

    def keys(self) -> list[K]:
        self.prune()
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: K) -> bool:
        return self.get(key) is not None


# -- waking a poller -------------------------------------------------------------------


class Waker:
    """A pipe a ``zmq.Poller`` can watch: ``wake()`` from any thread, ``drain()`` on the polling one."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: the poller is awake anyway

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._w)
        os.close(self._r)
