# SPDX-License-Identifier: Apache-2.0
"""EngineLoop: the engine thread that owns an EncodeWorker.

Other threads never touch the worker: they post commands to an inbox and the
engine thread applies them between steps, in arrival order. That order is
the scheduler's arrival sequence, so it is also what a tensor-parallel rank 0
would broadcast. Each request brings a ``Sink`` that receives its items and
its one terminal outcome on the engine thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Protocol

from epd_encoder.engine.worker import EncodeRequest, EncodeWorker, ItemResult, Outcome
from epd_encoder.errors import DuplicateRequest, EncodeFailed, EncoderError, NotReady, Overloaded

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Receives one request's results; called on the engine thread, must not block."""

    def on_item(self, result: ItemResult) -> None: ...
    def on_finish(self, outcome: Outcome) -> None: ...


@dataclass
class RequestResult:
    outcome: Outcome
    items: list[ItemResult]

    def release(self) -> None:
        """Unpin every item's cache entry (call once the outputs are consumed)."""
        for item in self.items:
            item.release()


@dataclass
class FutureSink:
    """Collects a request's items; ``future`` resolves with a RequestResult at the end."""

    future: Future = field(default_factory=Future)
    items: list[ItemResult] = field(default_factory=list)

    def on_item(self, result: ItemResult) -> None:
        self.items.append(result)

    def on_finish(self, outcome: Outcome) -> None:
        self.items.sort(key=lambda r: r.item_index)
        if outcome.state != "done":
            for item in self.items:
                item.release()
            self.items.clear()
        self.future.set_result(RequestResult(outcome, self.items))


class _Router:
    """The worker's deliverer: routes each result to its request's sink."""

    def __init__(self, on_end: Callable[[str], None]) -> None:
        self.sinks: dict[str, Sink] = {}
        self._on_end = on_end

    def deliver(self, result: ItemResult) -> None:
        self.sinks[result.request_id].on_item(result)

    def finish(self, outcome: Outcome) -> None:
        try:
            self.sinks.pop(outcome.request_id).on_finish(outcome)
        finally:
            self._on_end(outcome.request_id)


class EngineLoop:
    """Runs ``worker.step()`` on its own thread behind a thread-safe front.

    Admission is decided in the caller's thread, never behind a running
    forward: duplicate ids and the pending-cost bound are checked against a
    ledger of accepted, unfinished requests. A key's cost is charged once,
    by the first request that brings it, and stays charged until the last
    request holding it ends: a duplicate coalesces onto queued work at no
    cost. A worker that does not coalesce encodes each duplicate, so there
    each request pays for each of its keys. The summed charges bound the
    queued plus in-forward work.
    """

    def __init__(
        self,
        make_worker: Callable[[Any], EncodeWorker],
        *,
        max_pending_cost: int | None = None,
        wait_hint: Callable[[], float | None] | None = None,
        idle_wait_s: float = 0.5,
        name: str = "epd-engine",
    ) -> None:
        self._router = _Router(self._forget)
        self.worker = make_worker(self._router)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wait_hint = wait_hint
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._lock = threading.Lock()
        self._ledger: dict[str, tuple[Hashable, ...]] = {}  # request -> the keys it holds charges on
        self._charges: dict[Hashable, list[int]] = {}  # key -> [cost, holders]
        # A worker that does not coalesce (the reference baseline) encodes every duplicate:
        # each request is charged for each of its keys, under (request, key).
        self._per_request = not getattr(self.worker, "coalesces", True)
        self._outstanding = 0  # the sum of the charges' costs
        self._max_pending_cost = max_pending_cost
        self._accepting = False
        self._refusal: EncoderError | None = None  # set by fail_all: why new work is refused
        self._stop = threading.Event()
        self._drain = True

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._accepting = True
        self._thread.start()
        return self

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with ``drain`` finish in-flight work first, else cancel it."""
        with self._lock:
            self._accepting = False
        self._drain = drain
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def outstanding_cost(self) -> int:
        return self._outstanding

    @property
    def active_requests(self) -> int:
        return len(self._ledger)

    # -- commands (any thread) ---------------------------------------------------
    def precheck(self, request_id: str | None, charge: Mapping[bytes, int] | None = None) -> None:
        """Refuse early what ``submit`` would refuse anyway: 503 and 409 before any
        work; with ``charge`` (keys once known, before decoding) also 429, counting
        only keys no outstanding request holds, so a duplicate is never refused."""
        with self._lock:
            if not self._accepting:
                raise self._refused()
            if request_id in self._ledger:
                raise DuplicateRequest(f"request {request_id!r} is already in flight")
            if charge is not None:
                self._check_bound(sum(c for key, c in self._charged(request_id, charge).items()
                                      if key not in self._charges))

    def _charged(self, rid: str | None, charge: Mapping[bytes, int]) -> dict[Hashable, int]:
        out: dict[Hashable, int] = {}
        for key, c in charge.items():
            out[(rid, key) if self._per_request else key] = c
        return out

    def _check_bound(self, cost: int) -> None:
        bound = self._max_pending_cost
        # Nothing outstanding always admits, so a request over the bound still progresses.
        if bound is not None and cost and self._outstanding and self._outstanding + cost > bound:
            raise Overloaded(f"pending cost {self._outstanding} + {cost} exceeds {bound}")

    def submit(self, request: EncodeRequest, sink: Sink, *,
               charge: Mapping[bytes, int] | None = None) -> None:
        """Accept a request or raise ``NotReady``, ``DuplicateRequest`` or ``Overloaded``.

        ``charge`` maps the keys the request may queue to their cost; by default
        every key of the request (a caller that pinned cache hits leaves them
        out). Only keys no outstanding request holds count against the bound.
        Once this returns, ``sink.on_finish`` is called exactly once.
        """
        rid = request.request_id
        charged = self._charged(rid, {it.key: it.cost for it in request.items} if charge is None else charge)
        with self._lock:
            if not self._accepting:
                raise self._refused()
            if rid in self._ledger:
                raise DuplicateRequest(f"request {rid!r} is already in flight")
            cost = sum(c for key, c in charged.items() if key not in self._charges)
            self._check_bound(cost)
            for key, c in charged.items():
                self._charges.setdefault(key, [c, 0])[1] += 1
            self._ledger[rid] = tuple(charged)
            self._outstanding += cost
            # Enqueued under the lock: stop()'s sentinel always lands after it.
            self._inbox.put(("submit", request, sink))

    def fail_all(self, error: EncoderError) -> None:
        """The executor can no longer serve (a tensor-parallel rank died): refuse new work
        with ``error`` from now on, and end every accepted request with it. Any thread;
        applied on the engine thread once the forward in progress (if any) returns."""
        with self._lock:
            self._accepting = False
            self._refusal = error
        self._inbox.put(("fail_all", error))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def fail(self, request_id: str, error: EncoderError) -> None:
        self._inbox.put(("fail", request_id, error))

    def call(self, fn: Callable[[EncodeWorker], Any]) -> Future:
        """Run ``fn(worker)`` on the engine thread (stats, tests)."""
        done: Future = Future()
        self._inbox.put(("call", fn, done))
        return done

    def _refused(self) -> EncoderError:
        error = self._refusal
        # A fresh instance per request: one exception object raised in many threads tangles tracebacks.
        return type(error)(str(error)) if error is not None else NotReady("the engine is not accepting work")

    def _forget(self, request_id: str) -> None:
        with self._lock:
            for key in self._ledger.pop(request_id, ()):
                held = self._charges[key]
                held[1] -= 1
                if held[1] == 0:
                    del self._charges[key]
                    self._outstanding -= held[0]

    # -- engine thread -----------------------------------------------------------
    def _run(self) -> None:
        worker, progressed = self.worker, True
        try:
            while True:
                idle = worker.pending_size() == 0 or not progressed
                self._apply_inbox(block=idle and not self._stop.is_set())
                if self._stop.is_set() and (not self._drain or worker.pending_size() == 0):
                    break
                before = worker.pending_size()
                if before:
                    self._step()
                # No progress means the scheduler is holding a batch open (max-wait).
                progressed = worker.pending_size() != before
        except BaseException:  # never die silently: refuse new work, end what was accepted
            log.exception("engine loop crashed; failing every active request")
            with self._lock:
                self._accepting = False
            self._drain = False
        finally:
            self._shutdown()

    def _step(self) -> None:
        try:
            self.worker.step()
        except Exception as exc:  # a bug outside the executor: state is suspect, end it all
            log.exception("engine step failed")
            self.worker.fail_all(EncodeFailed(f"engine error: {exc!r}"))

    def _apply_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=self._block_for()) if block else self._inbox.get_nowait()
            while True:
                if cmd is not None:
                    self._apply(cmd)
                cmd = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _block_for(self) -> float:
        hint = self._wait_hint() if self._wait_hint else None
        return self._idle_wait_s if hint is None else max(0.0, min(hint, self._idle_wait_s))

    def _apply(self, cmd: tuple) -> None:
        op = cmd[0]
        if op == "submit":
            _, request, sink = cmd
            self._router.sinks[request.request_id] = sink
            try:
                self.worker.submit(request)
            except Exception as exc:  # accepted by the front: it still ends exactly once
                if not isinstance(exc, EncoderError):
                    log.exception("submit failed for %r", request.request_id)
                    exc = EncodeFailed(f"engine error: {exc!r}")
                if not self.worker.fail(request.request_id, exc):
                    self._router.finish(Outcome(request.request_id, "failed", exc))
        elif op == "cancel":
            self.worker.cancel(cmd[1])
        elif op == "fail":
            self.worker.fail(cmd[1], cmd[2])
        elif op == "fail_all":
            self.worker.fail_all(cmd[1])
        elif op == "call":
            _, fn, done = cmd
            try:
                done.set_result(fn(self.worker))
            except Exception as exc:
                done.set_exception(exc)

    def _shutdown(self) -> None:
        # Whatever is still active (a no-drain stop) is cancelled: one terminal state each.
        for rid in list(self._router.sinks):
            self.worker.fail(rid, NotReady("the engine stopped"), "cancelled")
        while not self._inbox.empty():
            cmd = self._inbox.get_nowait()
            if cmd and cmd[0] == "submit":
                self._router.sinks[cmd[1].request_id] = cmd[2]
                self._router.finish(Outcome(cmd[1].request_id, "cancelled", NotReady("the engine stopped")))
            elif cmd and cmd[0] == "call":
                cmd[2].set_exception(NotReady("the engine stopped"))
        try:  # no prefetch thread or buffer outlives the engine thread
            self.worker.close()
        except Exception:
            log.exception("closing the worker failed")
