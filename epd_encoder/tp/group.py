# SPDX-License-Identifier: Apache-2.0
"""The tensor-parallel rank group: rank 0 (this process) and N-1 spawned rank processes.

Topology: rank 0 owns everything a request touches (HTTP, preprocessing, cache,
scheduler) and is the only sender of messages; ranks 1..N-1 run a loop that
receives a message, checks the batch digest with every rank, and runs their
side of the mode's exchange (``RankHandler``). Transport is ``torch.distributed``
gloo over 127.0.0.1, rendezvous through a TCPStore that rank 0 opens on a free port.

Idle costs nothing: rank 0 sends ``Work`` only when there is a batch, and a
``Heartbeat`` (one small broadcast) when nothing went out for ``heartbeat_s / 2``;
the ranks block in the receive. So no rank waits ``heartbeat_s`` for a message
unless the heartbeat thread wakes ``heartbeat_s / 2`` late, and ``heartbeat_s``
need only be under ``timeout_s``. Never a collective per loop turn.

Failure: a rank that dies is seen by rank 0's watchdog (process exit status, checked
every ``heartbeat_s / 2`` and before every batch) or by the collective that touches it
(a closed socket fails at once); one that hangs fails the collective at
``timeout_s`` (gloo's own timeout). Either way rank 0 gets a typed ``RankFailed``
with the reason, every other rank is killed, and the group stays failed.
No rank outlives rank 0: each sets ``PR_SET_PDEATHSIG`` to SIGKILL first thing,
and rank 0 spawns them from a launcher thread that lives as long as the group
(the signal fires when the *thread* that forked the child exits).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

from epd_encoder.errors import EncoderError, RankFailed
from epd_encoder.tp.messages import Heartbeat, Shutdown, Work
from epd_encoder.tp.rank import BOOT, PR_SET_PDEATHSIG, RankHandler, resolve
from epd_encoder.tp.replica import CallLog, served_digest
from epd_encoder.tp.wire import agree, broadcast_flat, send_message

__all__ = ["RankGroup", "RankHandler", "agree", "broadcast_flat", "resolve", "threads_per_rank",
           "backend_environment", "DEFAULT_TIMEOUT_S", "DEFAULT_HEARTBEAT_S"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_HEARTBEAT_S = 1.0


def backend_for(device: str) -> str:
    """gloo for the host (messages, digests, CPU towers); NCCL for CUDA tensors when the
    tower runs on GPUs: the one process group then routes each collective by device."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def backend_environment(backend: str) -> dict[str, str]:
    """What ProcessGroupNCCL reads when it is built (torch has no option for it), so that a
    dead or hung peer is an exception in the thread that waits, at ``timeout_s`` at the
    latest, which ``run`` turns into ``RankFailed``: blocking wait (a collective's ``wait()``
    returns or raises in its caller, instead of failing later on the GPU stream), and a
    watchdog that only aborts the communicators (2), never the process (3, torch's default,
    would end the server by SIGABRT: no 503s, no exit status 1). Nothing for gloo."""
    if "nccl" not in backend:
        return {}
    return {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def threads_per_rank(size: int) -> int:
    """Each rank's intra-op threads: the cores split, never oversubscribed."""
    from epd_encoder.server.cpus import budget

    return budget().per_rank(size)


# -- rank 0 --------------------------------------------------------------------------------
class RankGroup:
    """Rank 0's handle on the group: ``start``, ``run`` batches, ``close``.

    ``factory`` (``"module:callable"``) is called as ``factory(rank, size, **args)`` in each
    other rank's process to build its ``RankHandler``; ``args`` is JSON (no pickle crosses
    to a rank, and no rank re-imports the server's main module). ``run`` is
    serialized (one batch at a time, heartbeats in between). ``on_failure`` is called once,
    from whichever thread saw the failure, with the ``RankFailed``: the server's cue to go
    unhealthy at once rather than at the next batch.

    ``scheduler`` (``replica.replica_args``) makes every rank replay rank 0's scheduler:
    ``log`` is then the ``CallLog`` for rank 0's ``RecordingScheduler``, and each batch's
    digest covers the batch every rank formed itself. ``device="cuda"`` runs the tower's
    collectives on NCCL (rank r on ``cuda:r``); messages always go over gloo on the host.
    """

    def __init__(self, size: int, factory: str, args: dict[str, Any] | None = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 start_timeout_s: float = 600.0, scheduler: dict[str, Any] | None = None,
                 device: str = "cpu",
                 on_failure: Callable[[RankFailed], None] | None = None) -> None:
        if size < 2:
            raise ValueError(f"a rank group needs at least 2 ranks, got {size}")
        if not 0 < heartbeat_s < timeout_s:
            raise ValueError(f"heartbeat_s ({heartbeat_s}) must be positive and under timeout_s "
                             f"({timeout_s}), or an idle rank would time out")
        self.size, self.timeout_s, self.heartbeat_s = size, timeout_s, heartbeat_s
        self.threads = threads_per_rank(size)
        self._factory, self._args = factory, dict(args or {})
        self._scheduler = scheduler
        json.dumps([self._args, scheduler])  # fails here, not in a rank
        self.log: CallLog | None = CallLog() if scheduler is not None else None
        self.backend = backend_for(device)
        self._start_timeout_s, self._on_failure = start_timeout_s, on_failure
        self._lock = threading.Lock()  # one sender on the wire at a time
        self._state = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._notes: dict[int, str] = {}
        self._failure: RankFailed | None = None
        self._sent = 0  # the last batch on the wire (what a heartbeat reports)
        self.heartbeats = 0  # sent so far (an idle group sends these and nothing else)
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._launched = threading.Event()
        self._reaped = threading.Event()  # the launcher thread's end: every rank is gone
        self._launch_error: BaseException | None = None
        self._initialized = False
        self._heart: threading.Thread | None = None
        self._launcher: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, setup: Callable[[], None] | None = None) -> "RankGroup":
        """Spawn the ranks and join the group; then ``setup()`` (rank 0's side of the handlers'
        ``setup``: collectives every rank runs once, e.g. combining the shard digests)."""
        torch.set_num_threads(self.threads)  # rank 0 takes its share too
        if self.backend != "gloo":
            torch.cuda.set_device(0)
        # Rank 0's own ProcessGroupNCCL reads these at init_process_group; the ranks get them at spawn.
        os.environ.update(backend_environment(self.backend))
        store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=self.timeout_s))
        self._launcher = threading.Thread(target=self._launch, args=(store.port,), name="tp-launcher",
                                          daemon=True)
        self._launcher.start()
        self._launched.wait()
        if self._launch_error is not None:
            self._kill_all()
            self._closed.set()
            self._end_launcher()
            raise RankFailed(f"could not spawn the ranks: {self._launch_error!r}") from self._launch_error
        try:
            self._await_ready()
            dist.init_process_group(self.backend, store=store, rank=0, world_size=self.size,
                                    timeout=timedelta(seconds=self.timeout_s))
            self._initialized = True
            if setup is not None:
                setup()
        except BaseException:
            self._kill_all()
            if self._initialized:  # a failed setup: leave no process group behind
                dist.destroy_process_group()
                self._initialized = False
            self._closed.set()
            self._end_launcher()
            raise
        self._heart = threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True)
        self._heart.start()
        log.info("tensor-parallel group of %d up: ranks %s, %d threads each", self.size,
                 [p.pid for p in self._procs], self.threads)
        return self

    def _launch(self, port: int) -> None:
        # This thread forks the ranks and lives until close: PR_SET_PDEATHSIG fires on the
        # exit of the forking thread, not of the process.
        boot = BOOT.format(pdeathsig=PR_SET_PDEATHSIG, parent=os.getpid())
        try:
            for rank in range(1, self.size):
                r, w = os.pipe()
                spec = dict(rank=rank, size=self.size, port=port, timeout_s=self.timeout_s, threads=self.threads,
                            factory=self._factory, args=self._args, fd=w, scheduler=self._scheduler,
                            backend=self.backend)
                try:
                    p = subprocess.Popen([sys.executable, "-c", boot, json.dumps(spec)], pass_fds=(w,),
                                         stdin=subprocess.DEVNULL,
                                         env={**os.environ, **backend_environment(self.backend)})
                finally:
                    os.close(w)
                self._procs.append(p)
                self._conns.append(Connection(r, writable=False))
        except BaseException as e:
            self._launch_error = e
        finally:
            self._launched.set()
        self._reaped.wait()

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        waiting = dict(zip(self._conns, range(1, self.size)))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"ranks {sorted(waiting.values())} not ready within {self._start_timeout_s:g} s")
            for ready in wait(list(waiting), timeout=left):
                c = typing.cast(Connection, ready)
                rank = waiting[c]
                try:
                    kind, value = json.loads(c.recv_bytes())
                except EOFError:
                    raise RankFailed(self._describe_exit(rank)) from None
                if kind != "ready":
                    raise RankFailed(str(value))
                del waiting[c]

    def close(self, reason: str = "") -> None:
        """Shutdown to every rank, then the group down; idempotent. Ranks exit 0 on a clean close."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._heart is not None:
            self._heart.join()
        with self._lock:
            if self._failure is None and self._initialized:
                try:
                    send_message(Shutdown(reason))
                except Exception as e:
                    log.warning("shutdown broadcast failed: %s", e)
            deadline = time.monotonic() + 10.0
            for p in self._procs:
                _join(p, max(0.0, deadline - time.monotonic()))
            self._kill_all()
            if self._initialized:
                dist.destroy_process_group()
                self._initialized = False
            for c in self._conns:
                c.close()
            self._end_launcher()

    def _end_launcher(self) -> None:
        """Every rank is reaped: the launcher thread ends, and is gone when this returns."""
        self._reaped.set()
        if self._launcher is not None and self._launcher is not threading.current_thread():
            self._launcher.join()

    def __enter__(self) -> "RankGroup":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- queries ---------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def exitcodes(self) -> list[int | None]:
        return [p.poll() for p in self._procs]

    @property
    def failure(self) -> RankFailed | None:
        return self._failure

    # -- batches ---------------------------------------------------------------------------
    def run(self, work: Work, exchange: Callable[[Work], T]) -> T:
        """Number ``work`` (its ``seq`` is replaced by the next batch number), send it,
        agree on its digest, then run rank 0's side of the exchange.

        An ``EncoderError`` the exchange raises after completing the protocol (a forward
        that failed on some rank: ``EncodeFailed``) fails the batch only; anything else
        from the wire fails the group with ``RankFailed``.
        """
        with self._lock:
            self.check()
            work = msgspec.structs.replace(work, seq=self._sent + 1, calls=self._drain())
            digest = work.digest() if self.log is None else served_digest(work.digest(), self.log.latest())
            try:
                send_message(work)
                self._sent = work.seq
                self._last_send = time.monotonic()
                agree(digest, work.seq)
                return exchange(work)
            except RankFailed as e:
                raise self._fail(e) from e
            except EncoderError:
                raise
            except Exception as e:
                raise self._fail(RankFailed(self._reason(f"batch {work.seq}: {type(e).__name__}: {e}"))) from e
            finally:
                self._last_send = time.monotonic()

    def check(self) -> None:
        """Raise the group's ``RankFailed`` if it failed or a rank has exited."""
        if self._failure is not None:
            raise self._failure
        if self._closed.is_set():
            raise RankFailed("the tensor-parallel group is closed")
        for rank, p in enumerate(self._procs, 1):
            if p.poll() is not None:
                raise self._fail(RankFailed(self._describe_exit(rank)))

    # -- internals -------------------------------------------------------------------------
    def _drain(self) -> list:
        """The scheduler calls not yet sent; only under the wire lock, so they go out in order."""
        return self.log.drain() if self.log is not None else []

    def _heartbeat(self) -> None:
        # Due half a heartbeat after the last send (a batch's end counts): every gap stays
        # under heartbeat_s unless this thread wakes more than heartbeat_s/2 late.
        half = self.heartbeat_s / 2
        while not self._closed.wait(max(0.0, self._last_send + half - time.monotonic())):
            try:
                self.check()
            except RankFailed:
                return
            if not self._lock.acquire(timeout=half):
                continue  # a batch is on the wire: its end is the next send; the watchdog ran
            try:
                if (self._failure is None and not self._closed.is_set()
                        and time.monotonic() - self._last_send >= half):
                    send_message(Heartbeat(self._sent, self._drain()))
                    self._last_send = time.monotonic()
                    self.heartbeats += 1
            except Exception as e:
                self._fail(RankFailed(self._reason(f"heartbeat: {e}")))
                return
            finally:
                self._lock.release()

    def _fail(self, error: RankFailed) -> RankFailed:
        with self._state:
            first = self._failure is None
            if first:
                self._failure = error
        if not first:
            return self._failure  # type: ignore[return-value]
        log.error("tensor-parallel group failed: %s", error)
        self._kill_all()  # no rank is left waiting in a broken collective
        if self._on_failure is not None:
            try:
                self._on_failure(error)
            except Exception:
                log.exception("on_failure callback failed")
        return error

    def _kill_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            _join(p, 5.0)

    def _note(self, rank: int) -> str:
        """The last word rank ``rank`` sent on its pipe (its reason for leaving), if any."""
        conn = self._conns[rank - 1]
        try:
            while conn.poll():
                kind, value = json.loads(conn.recv_bytes())
                if kind == "failed":
                    self._notes[rank] = str(value)
        except (EOFError, OSError):
            pass
        return self._notes.get(rank, "")

    def _describe_exit(self, rank: int) -> str:
        p = self._procs[rank - 1]
        _join(p, 1.0)
        code = p.poll()
        how = "is gone" if code is None else (f"was killed by {signal.Signals(-code).name}" if code < 0
                                              else f"exited with status {code}")
        note = self._note(rank)
        return f"rank {rank} (pid {p.pid}) {how}" + (f": {note}" if note else "")

    def _reason(self, what: str) -> str:
        """``what`` plus the exit of any rank that is gone (the usual root cause)."""
        gone = []
        for rank, p in enumerate(self._procs, 1):
            _join(p, 0.5)
            if p.poll() is not None:
                gone.append(self._describe_exit(rank))
        return "; ".join(gone + [what]) if gone else what


def _join(p: subprocess.Popen, timeout: float) -> None:
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
