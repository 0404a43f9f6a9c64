# SPDX-License-Identifier: Apache-2.0
"""The shared tier (L3): a fleet-wide cache on Mooncake Store, below L1 and L2.

The front looks a key up here after an L1/L2 miss, before it decodes (``lookup``, on the
event loop: one store read per key however many requests want it). A hit is the item's full
output, checked (cache/shared_format.py) and copied to the device. After an encode, the front
``offer``s the output; a writer thread copies it to the host and writes it, so neither a
forward nor the event loop ever waits for the store. Every failure (store down, slow, full,
breaker open, entry corrupt) is a miss or a dropped write, counted, never a failed request.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from epd_encoder.cache.shared_client import GuardedStore, Unavailable
from epd_encoder.cache.shared_format import (
    MAX_META_BYTES,
    CorruptEntry,
    decode_meta,
    decode_value,
    encode_entry,
    meta_key,
    value_key,
)
from epd_encoder.cache.shared_mooncake import Backend

if TYPE_CHECKING:
    from epd_encoder.types import ItemOutput

log = logging.getLogger(__name__)
_STOP = object()


@dataclass
class SharedStats:
    """Cumulative counts (``errors`` by (op, reason), ``dropped`` by reason)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    removals: int = 0
    errors: dict[tuple[str, str], int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Write:
    key: str
    output: Any
    grid_thw: tuple[int, int, int]
    modality: str
    video: dict | None


class SharedTier:
    def __init__(self, store: GuardedStore, *, namespace: str, read_deadline_s: float,
                 write_deadline_s: float, write_queue: int, max_bytes: int, lease_s: float,
                 to_device: Callable[[ItemOutput], ItemOutput] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.namespace = store, namespace
        self._read_deadline, self._write_deadline = read_deadline_s, write_deadline_s
        self._max_bytes, self._lease_s, self._clock = max_bytes, lease_s, clock
        self._to_device = to_device or (lambda v: v)
        self._lock = threading.Lock()
        self._stats = SharedStats()
        self._lookups: dict[bytes, asyncio.Future] = {}  # event loop only
        self._queue: queue.Queue = queue.Queue(maxsize=write_queue)
        self._written: OrderedDict[str, None] = OrderedDict()  # recent writes, not offered again
        self._removals: list[tuple[float, int, str, int]] = []  # (due, seq, key, attempt), writer only
        self._seq = 0
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="epd-l3-writer", daemon=True)

    def start(self) -> None:
        self.store.start()
        self._writer.start()

    def close(self) -> None:
        """Stop without flushing: queued writes are dropped (a cache loses nothing by it), and
        a store call in flight is not waited for beyond a second."""
        self._closing = True  # offers from now on are refused, so the stop below finds room
        while True:
            self._drain_queue()
            try:
                self._queue.put_nowait(_STOP)
                break
            except queue.Full:  # an offer or a removal's wake-up landed after the drain
                continue
        self.store.close(timeout_s=1.0)  # refuses new calls at once: the writer ends its job quickly
        if self._writer.is_alive():
            self._writer.join(timeout=1.0)

    @property
    def stats(self) -> SharedStats:
        with self._lock:
            s = self._stats
            return SharedStats(s.hits, s.misses, s.corrupt, s.bytes_read, s.bytes_written, s.writes,
                               s.removals, dict(s.errors), dict(s.dropped))

    @property
    def queued_writes(self) -> int:
        return self._queue.qsize()

    # -- lookups (event loop) -------------------------------------------------------
    async def lookup(self, key: bytes, *, grid_thw: tuple[int, int, int], num_tokens: int) -> ItemOutput | None:
        """The item's output on the device, or None (a miss, whatever the reason). Concurrent
        lookups of one key share one store read; a caller's cancellation leaves it running."""
        flight = self._lookups.get(key)
        if flight is None:
            flight = asyncio.ensure_future(self._get(key, tuple(grid_thw), num_tokens))
            self._lookups[key] = flight
            flight.add_done_callback(lambda _f: self._lookups.pop(key, None))
        return await asyncio.shield(flight)

    async def _get(self, key: bytes, grid_thw: tuple, num_tokens: int) -> ItemOutput | None:
        hexkey = key.hex()
        try:
            found = await self.store.acall("read", lambda b: self._read(b, hexkey, grid_thw, num_tokens),
                                           self._read_deadline)
        except Unavailable as e:
            self._count_error("get", e.reason)
            found = None
        except CorruptEntry as e:
            log.warning("shared cache: entry %s… is corrupt (%s); it is a miss and will be removed",
                        hexkey[:16], e)
            with self._lock:
                self._stats.corrupt += 1
            self._schedule_removal(hexkey)
            found = None
        except Exception:  # a device copy out of memory, say: a miss, never a failed request
            log.exception("shared cache: reading %s… failed", hexkey[:16])
            self._count_error("get", "error")
            found = None
        with self._lock:
            if found is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._stats.bytes_read += found[1]
        return found[0]

    def _read(self, backend: Backend, hexkey: str, grid_thw: tuple, num_tokens: int) -> tuple[Any, int] | None:
        """On a read thread: the sidecar, then the object, checked, then copied to the device."""
        import torch

        buf = torch.empty(MAX_META_BYTES, dtype=torch.uint8)
        n = backend.read(meta_key(self.namespace, hexkey), buf)
        if n is None:
            return None
        if n < 0:
            raise CorruptEntry(f"sidecar over {MAX_META_BYTES} bytes")
        meta = decode_meta(hexkey, buf[:n].numpy().tobytes())
        if meta.nbytes > self._max_bytes:
            return None  # this server could not have written it either
        value = torch.empty(meta.nbytes, dtype=torch.uint8)
        n = backend.read(value_key(self.namespace, hexkey), value)
        if n is None:
            return None  # evicted apart from its sidecar
        if n != meta.nbytes:
            raise CorruptEntry(f"object is {'larger than' if n < 0 else n} {meta.nbytes} bytes")
        out = decode_value(meta, value, grid_thw=grid_thw, num_tokens=num_tokens)
        return self._to_device(out), meta.nbytes

    # -- writes (any thread; the writer thread does the work) -------------------------
    def offer(self, key: bytes, output: ItemOutput, *, grid_thw: tuple[int, int, int], modality: str,
              video: dict | None = None) -> bool:
        """Queue ``output`` (on its device) to be written; never blocks. False when dropped."""
        hexkey = key.hex()
        with self._lock:
            if self._closing or hexkey in self._written:
                return False
        try:
            self._queue.put_nowait(_Write(hexkey, output, grid_thw, modality, video))
        except queue.Full:
            self._count_dropped("queue_full")
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            wait = None
            if self._removals:
                wait = max(0.0, self._removals[0][0] - self._clock())
            try:
                job = self._queue.get(timeout=wait)
            except queue.Empty:
                job = None
            if job is _STOP:
                return
            self._due_removals()
            if job is not None:
                try:
                    self._write(job)
                except Exception:
                    log.exception("shared cache: writing %s… failed", job.key[:16])
                    self._count_error("put", "error")

    def _write(self, job: _Write) -> None:
        entry = encode_entry(job.key, job.output, grid_thw=job.grid_thw, modality=job.modality,
                             video=job.video)  # the device-to-host copy runs here, off the engine
        if entry.nbytes > self._max_bytes:
            self._count_dropped("too_large")
            return
        written: str | None = None
        try:
            written = self.store.call(
                "write", lambda b: b.write(value_key(self.namespace, job.key), entry.header, entry.body),
                self._write_deadline)
            if written == "refused":
                self._count_dropped("too_large")
                return
            # An object we did not write (a racing server's, or a vLLM producer's) gets no
            # sidecar from us: we cannot vouch for its bytes.
            if written == "stored":
                try:
                    self.store.call("write", lambda b: b.write(meta_key(self.namespace, job.key), entry.meta),
                                    self._write_deadline)
                except Unavailable:
                    # Sidecar-less, the object would be "exists" to every writer: a miss for good.
                    self._schedule_removal(job.key)
                    raise
        except Unavailable as e:
            self._count_error("put", e.reason)
            if e.reason == "timeout" and written is None:  # the object may land yet, sidecar-less
                self._schedule_removal(job.key)
            return
        if written != "stored":
            return
        with self._lock:  # not offered again while recent (an "exists" is: it may be a corrupt one)
            self._written[job.key] = None
            if len(self._written) > 4096:
                self._written.popitem(last=False)
            self._stats.writes += 1
            self._stats.bytes_written += entry.nbytes

    # -- removal of corrupt entries (writer thread) -----------------------------------
    def _schedule_removal(self, hexkey: str, attempt: int = 0, delay: float | None = None) -> None:
        # The read that found it corrupt holds a lease: Mooncake refuses remove (-706) until it ends.
        due = self._clock() + (self._lease_s if delay is None else delay)
        with self._lock:
            self._written.pop(hexkey, None)
            self._seq += 1
            heapq.heappush(self._removals, (due, self._seq, hexkey, attempt))
        try:
            self._queue.put_nowait(None)  # wake the writer so it sees the new due time
        except queue.Full:
            pass

    def _due_removals(self) -> None:
        while True:
            with self._lock:
                if not self._removals or self._removals[0][0] > self._clock():
                    return
                _, _, hexkey, attempt = heapq.heappop(self._removals)
            try:
                removed = self.store.call("write", lambda b: self._remove(b, hexkey), self._write_deadline)
            except Unavailable as e:
                self._count_error("remove", e.reason)
                removed = False
            if removed:
                with self._lock:
                    self._stats.removals += 1
            elif attempt < 3:
                self._schedule_removal(hexkey, attempt + 1)

    def _remove(self, backend: Backend, hexkey: str) -> bool:
        ok = backend.remove(meta_key(self.namespace, hexkey))  # the sidecar first: readers miss at once
        return backend.remove(value_key(self.namespace, hexkey)) and ok

    # -- counts ---------------------------------------------------------------------------
    def _count_error(self, op: str, reason: str) -> None:
        with self._lock:
            self._stats.errors[(op, reason)] = self._stats.errors.get((op, reason), 0) + 1

    def _count_dropped(self, reason: str) -> None:
        with self._lock:
            self._stats.dropped[reason] = self._stats.dropped.get(reason, 0) + 1

    def _drain_queue(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
