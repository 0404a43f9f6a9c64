# SPDX-License-Identifier: Apache-2.0
"""Pieces of the push control plane shared by the sender and the receiver.

* ``Delivery`` / ``parse_delivery``: the ``delivery`` object of a push encode
  request (docs/protocol.md), built by the receiver and validated by the sender.
* ``RecordBook``: finished-room records bounded by age and count, so neither
  side's memory grows with the number of rooms it has ever seen.
* ``error_for_code``: the ``EncoderError`` class a wire ``code`` stands for.
* ``Waker``: wakes a thread blocked in ``zmq.Poller.poll`` from another thread.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, TypeVar

from epd_encoder.errors import EncoderError, SchemaError, error_class
from epd_encoder.transfer.base import backends

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


# -- delivery ------------------------------------------------------------------------


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


def _target(raw: Any, i: int) -> Target:
    if not isinstance(raw, dict):
        raise SchemaError(f"delivery.targets[{i}] must be an object")
    endpoint, rank, info = raw.get("endpoint"), raw.get("rank", 0), raw.get("info", {})
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
        raise SchemaError(f"delivery.targets[{i}].endpoint must be a tcp:// or ipc:// address")
    if type(rank) is not int or rank < 0:
        raise SchemaError(f"delivery.targets[{i}].rank must be an int >= 0")
    if not isinstance(info, dict):
        raise SchemaError(f"delivery.targets[{i}].info must be an object")
    return Target(endpoint, rank, info)


def parse_delivery(raw: Any) -> Delivery:
    """Validate a push ``delivery`` object; ``SchemaError`` names the first bad field."""
    if not isinstance(raw, dict):
        raise SchemaError("delivery must be an object")
    if raw.get("mode") != "push":
        raise SchemaError(f"delivery.mode must be 'push', got {raw.get('mode')!r}")
    backend = raw.get("backend")
    if backend not in backends():
        raise SchemaError(f"delivery.backend must be one of {list(backends())}, got {backend!r}")
    room = raw.get("room")
    if not isinstance(room, str) or not 1 <= len(room) <= 256:
        raise SchemaError("delivery.room must be a string of 1-256 chars")
    targets = raw.get("targets")
    if not isinstance(targets, list) or not 1 <= len(targets) <= 64:
        raise SchemaError("delivery.targets must be a list of 1-64 targets")
    parsed = tuple(_target(t, i) for i, t in enumerate(targets))
    if len({t.endpoint for t in parsed}) != len(parsed) or len({t.rank for t in parsed}) != len(parsed):
        raise SchemaError("delivery.targets must not repeat an endpoint or a rank")
    timeout = raw.get("bootstrap_timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise SchemaError("delivery.bootstrap_timeout must be a positive number of seconds")
    return Delivery(backend, room, parsed, None if timeout is None else float(timeout))


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
