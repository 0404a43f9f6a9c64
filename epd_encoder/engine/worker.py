# SPDX-License-Identifier: Apache-2.0
"""EncodeWorker: the engine loop body (submit, step, cancel), single-threaded.

Every call happens on the engine thread (``EngineLoop`` serializes them), so
the worker holds no locks. Collaborators are injected and typed as Protocols;
tests drive it with fakes.

Terminal states: every request accepted by ``submit`` ends exactly once with
``Deliverer.finish`` — ``done``, ``failed`` (with a typed reason) or
``cancelled``. A rejected submit (``Overloaded``, ``DuplicateRequest``) raises
and was never accepted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, Sequence

from epd_encoder.engine.coalescer import Flight, InflightTable
from epd_encoder.engine.scheduler import PendingEncodeItem
from epd_encoder.errors import (
    Cancelled,
    DuplicateRequest,
    EncodeFailed,
    EncoderError,
    Overloaded,
)
from epd_encoder.types import ItemOutput

log = logging.getLogger(__name__)

CacheState = Literal["hit", "miss", "coalesced"]
TerminalState = Literal["done", "failed", "cancelled"]


class Executor(Protocol):
    def encode(self, payloads: Sequence[Any]) -> Sequence[ItemOutput | BaseException]:
        """One forward for the batch; one output (or a per-item error) per payload."""
        ...


class Prefetcher(Protocol):
    """Optional executor capability: finish the likely next batch's inputs while the
    current forward runs (docs/engine.md, "Prefetching the next batch's finish")."""

    def prefetch(self, payloads: Sequence[Any]) -> None:
        """The payloads the next ``encode`` will probably get; a wrong guess costs only
        wasted work. Called on the engine thread right before ``encode``."""
        ...

    def drop_prefetch(self, *, stop: bool = False) -> None:
        """Drop prefetched work and its buffers; with ``stop`` also end any side thread."""
        ...


class Scheduler(Protocol):
    def add(self, item: PendingEncodeItem) -> None: ...
    def next_batch(self) -> list[PendingEncodeItem]: ...
    def cancel(self, request_id: str) -> int: ...
    def pending_size(self) -> int: ...
    def pending_cost(self) -> int: ...
    # Optional: ``peek_batch() -> list[PendingEncodeItem]``, what ``next_batch`` would
    # return now, changing no state; with a ``Prefetcher`` executor it enables prefetch.


class Cache(Protocol):
    def acquire(self, key: bytes) -> ItemOutput | None:
        """A get that pins the entry until ``release``."""
        ...

    def pin(self, key: bytes) -> bool:
        """Pin a stored entry without counting a lookup; False if absent."""
        ...

    def release(self, key: bytes) -> None: ...
    def put(self, key: bytes, value: ItemOutput, nbytes: int) -> bool: ...


@dataclass(frozen=True)
class ItemResult:
    request_id: str
    item_index: int
    key: bytes
    output: ItemOutput
    cache: CacheState
    release: Callable[[], None]
    """Unpins the cache entry; the deliverer calls it exactly once when done with ``output``."""


@dataclass(frozen=True)
class Outcome:
    request_id: str
    state: TerminalState
    error: EncoderError | None = None


class Deliverer(Protocol):
    def deliver(self, result: ItemResult) -> None: ...
    def finish(self, outcome: Outcome) -> None: ...


@dataclass(frozen=True)
class WorkItem:
    """One vision item: its content key, scheduler cost and executor payload.

    ``error`` marks an item that already failed upstream (say, undecodable):
    it fails its own request at submit and touches nothing else. ``parts``,
    when given, replaces the payload on a miss by ``(payload, cost)`` chunks
    scheduled as separate units (a long video, by whole temporal groups); the
    item's output is theirs concatenated in order. ``ready`` is an output the front
    already has (a shared-tier hit): delivered as a hit and stored, never encoded.
    """

    key: bytes
    cost: int
    payload: Any = None
    error: EncoderError | None = None
    parts: tuple[tuple[Any, int], ...] = ()
    ready: ItemOutput | None = None


@dataclass(frozen=True)
class EncodeRequest:
    request_id: str
    items: tuple[WorkItem, ...]


class _Request:
    __slots__ = ("remaining",)

    def __init__(self, n: int) -> None:
        self.remaining = n


def _noop() -> None:
    return None


class EncodeWorker:
    """Cache lookup, coalescing, scheduling and scatter around one executor."""

    def __init__(
        self,
        *,
        executor: Executor,
        scheduler: Scheduler,
        cache: Cache,
        deliverer: Deliverer,
        max_pending_cost: int | None = None,
        coalesce: bool = True,
    ) -> None:
        """``coalesce=False`` encodes every miss itself, even a key already in flight
        (cache hits still count): the reference baseline's policy, for comparisons."""
        if max_pending_cost is not None and max_pending_cost <= 0:
            raise ValueError("max_pending_cost must be positive")
        self._executor, self._scheduler = executor, scheduler
        self._cache, self._deliverer = cache, deliverer
        self._max_pending_cost = max_pending_cost
        self._inflight = InflightTable(coalesce=coalesce)
        self._requests: dict[str, _Request] = {}
        self._peek: Callable[[], list[PendingEncodeItem]] | None = getattr(scheduler, "peek_batch", None)
        has = all(callable(getattr(executor, name, None)) for name in ("prefetch", "drop_prefetch"))
        self._prefetcher: Prefetcher | None = executor if has and self._peek is not None else None  # type: ignore[assignment]

    # -- queries ---------------------------------------------------------------
    @property
    def active_requests(self) -> int:
        return len(self._requests)

    @property
    def coalesces(self) -> bool:
        """Whether a duplicate of in-flight work joins its flight (off: the reference baseline)."""
        return self._inflight.coalesce

    @property
    def coalesced_total(self) -> int:
        return self._inflight.coalesced_total

    def is_active(self, request_id: str) -> bool:
        return request_id in self._requests

    def pending_size(self) -> int:
        return self._scheduler.pending_size()

    # -- commands --------------------------------------------------------------
    def submit(self, request: EncodeRequest) -> None:
        """Accept a request or raise (``DuplicateRequest``, ``Overloaded``).

        Per item: a cache hit is delivered at once, a key in flight attaches
        as a waiter, a miss opens a flight and is scheduled.
        """
        rid = request.request_id
        if rid in self._requests:
            raise DuplicateRequest(f"request {rid!r} is already in flight")
        self._admit(request)
        self._requests[rid] = _Request(len(request.items))
        bad = next((it.error for it in request.items if it.error is not None), None)
        if bad is not None:
            self._end(rid, "failed", bad)
            return
        for index, item in enumerate(request.items):
            slot = (rid, index)
            if item.ready is not None:  # promoted into the cache; the result holds its own reference
                self._store(item.key, item.ready)
                self._deliver(rid, index, item.key, item.ready, "hit", _noop)
            elif item.key in self._inflight:
                self._inflight.attach(item.key, slot)
            elif (hit := self._lookup(item.key)) is not None:
                self._deliver(rid, index, item.key, hit, "hit", lambda k=item.key: self._cache.release(k))
            else:
                flight = self._inflight.open(item.key, item.payload, item.cost, slot, item.parts)
                for part, (_, cost) in enumerate(item.parts or ((None, item.cost),)):
                    self._scheduler.add(PendingEncodeItem(flight.unit_id, part, cost))
            if rid not in self._requests:  # a delivery failure ended it
                return
        if not request.items:
            self._end(rid, "done")

    def step(self) -> int:
        """Encode one batch; returns how many units it encoded (0 if idle or failed)."""
        batch = self._scheduler.next_batch()
        if not batch:
            return 0
        units = [(self._inflight.unit(u.request_id), u.item_index) for u in batch]
        # Close each flight whose last parts are in this batch first: terminal callbacks
        # below may detach requests, and must never see (or unschedule) these flights.
        # A flight with parts still queued stays open, so a cancel unschedules them.
        for flight, _ in units:
            flight.unbatched -= 1
            if flight.unbatched == 0:
                self._inflight.land(flight)
        self._prefetch_next()
        try:
            outputs = list(self._executor.encode([f.payload_of(part) for f, part in units]))
            if len(outputs) != len(units):
                raise EncodeFailed(f"executor returned {len(outputs)} outputs for {len(units)} items")
        except Exception as exc:  # the batch fails; the worker keeps serving
            reason = exc if isinstance(exc, EncoderError) else EncodeFailed(f"vision tower failed: {exc!r}")
            for flight in {id(f): f for f, _ in units}.values():
                self._land_failed(flight, reason)
            return 0
        encoded = 0
        for (flight, part), out in zip(units, outputs):
            if flight.failed:
                continue
            if isinstance(out, BaseException):
                err = out if isinstance(out, EncoderError) else EncodeFailed(f"item failed: {out!r}")
                self._land_failed(flight, err)
                continue
            encoded += 1
            whole = flight.add_output(part, out)
            if whole is not None:
                self._land(flight, whole)
        return encoded

    def close(self) -> None:
        """Drop any prefetched work and end the executor's prefetch thread (engine shutdown)."""
        if self._prefetcher is not None:
            self._prefetcher.drop_prefetch(stop=True)

    def cancel(self, request_id: str) -> bool:
        """Cancel a request (client gone); False when it is no longer active."""
        return self.fail(request_id, Cancelled(f"request {request_id!r} was cancelled"), "cancelled")

    def fail_all(self, error: EncoderError) -> int:
        """End every active request with ``error``; returns how many."""
        rids = list(self._requests)
        for rid in rids:
            self._end(rid, "failed", error)
        return len(rids)

    def fail(self, request_id: str, error: EncoderError, state: TerminalState = "failed") -> bool:
        """End an active request with ``error`` (a timeout, say)."""
        if request_id not in self._requests:
            return False
        self._end(request_id, state, error)
        return True

    # -- internals -------------------------------------------------------------
    def _prefetch_next(self) -> None:
        # The preview is the pending batch after this one; the scheduler stays untouched,
        # so tensor-parallel ranks replaying scheduler calls still form the same batches.
        if self._prefetcher is None or self._peek is None:
            return
        try:
            units = [(self._inflight.unit(u.request_id), u.item_index) for u in self._peek()]
            self._prefetcher.prefetch([f.payload_of(part) for f, part in units if f is not None])
        except Exception:  # an optimisation only: the batch is finished in line instead
            log.exception("prefetch failed")

    def _admit(self, request: EncodeRequest) -> None:
        if self._max_pending_cost is None:
            return
        if self._inflight.coalesce:
            extra = sum({it.key: it.cost for it in request.items
                         if it.key not in self._inflight and it.ready is None}.values())
        else:
            extra = sum(it.cost for it in request.items if it.ready is None)
        # ``extra`` is an over-estimate: some may be cache hits.
        pending = self._scheduler.pending_cost()
        # An empty queue always admits, so a request over the bound still progresses.
        if pending > 0 and pending + extra > self._max_pending_cost:
            raise Overloaded(
                f"pending cost {pending} + {extra} exceeds the bound {self._max_pending_cost}"
            )

    # A cache that raises (a device copy out of memory, say) degrades to a miss or
    # an unstored output; it never takes the engine down.
    def _lookup(self, key: bytes) -> ItemOutput | None:
        try:
            return self._cache.acquire(key)
        except Exception:
            log.exception("cache lookup failed; treating it as a miss")
            return None

    def _store(self, key: bytes, out: ItemOutput) -> bool:
        try:
            return self._cache.put(key, out, out.nbytes)
        except Exception:
            log.exception("cache put failed; the output is delivered unstored")
            return False

    def _pin(self, key: bytes) -> bool:
        try:
            return self._cache.pin(key)
        except Exception:
            log.exception("cache pin failed")
            return False

    def _land(self, flight: Flight, out: ItemOutput) -> None:
        stored = self._store(flight.key, out)
        for rid, index in flight.waiters:
            if rid not in self._requests:
                continue
            pinned = stored and self._pin(flight.key)
            release = (lambda k=flight.key: self._cache.release(k)) if pinned else _noop
            state: CacheState = "miss" if (rid, index) == flight.opener else "coalesced"
            self._deliver(rid, index, flight.key, out, state, release)

    def _land_failed(self, flight: Flight, error: EncoderError) -> None:
        # Ending every waiter's request also unschedules the parts still queued.
        flight.failed = True
        flight.outputs.clear()
        for rid in dict.fromkeys(r for r, _ in flight.waiters):
            if rid in self._requests:
                self._end(rid, "failed", error)

    def _deliver(self, rid: str, index: int, key: bytes, out: ItemOutput, state: CacheState,
                 release: Callable[[], None]) -> None:
        try:
            self._deliverer.deliver(ItemResult(rid, index, key, out, state, release))
        except Exception as exc:
            release()
            err = exc if isinstance(exc, EncoderError) else EncodeFailed(f"delivery failed: {exc!r}")
            self._end(rid, "failed", err)
            return
        req = self._requests[rid]
        req.remaining -= 1
        if req.remaining == 0:
            self._end(rid, "done")

    def _end(self, rid: str, state: TerminalState, error: EncoderError | None = None) -> None:
        del self._requests[rid]
        for orphan in self._inflight.detach_request(rid):
            self._scheduler.cancel(orphan.unit_id)
        try:
            self._deliverer.finish(Outcome(rid, state, error))
        except Exception:  # a broken sink must not corrupt the worker's state
            log.exception("deliverer.finish failed for request %r", rid)
        if self._prefetcher is not None and self._scheduler.pending_size() == 0:
            try:  # nothing is left that a prefetch could be for: free its buffers now
                self._prefetcher.drop_prefetch()
            except Exception:
                log.exception("drop_prefetch failed")
