# SPDX-License-Identifier: Apache-2.0
"""Replicated scheduling: every rank forms each batch itself, from the same scheduler calls.

Rank 0's engine drives a ``RecordingScheduler``: the real scheduler, plus a ``CallLog`` of
every call that changes its state (``Add``, ``Cancel``, and a ``Take`` for each non-empty
``next_batch``). The log rides to the other ranks in the next message on the wire (a
``Work``, or an idle ``Heartbeat``), drained under the group's wire lock, so every rank
receives the calls in the order rank 0 made them. Each rank replays them on its own
``SchedulerReplica`` (the same scheduler class and limits) and so forms the batch of each
``Take`` itself. Before a forward, every rank folds the batch of the latest ``Take`` into
its digest (``served_digest``); the digests are all-gathered and compared, so a rank whose
scheduler disagreed, by a bug or a nondeterminism (hash order, a clock, a float), fails
with a typed ``RankMismatch`` instead of running collectives on another batch.

Only what the scheduler decides without a clock is replayed: ``max_wait_s`` (hold a
batch while it fills) is decided on rank 0, and an empty ``next_batch`` changes nothing,
so it is not a call. A ``Take`` whose batch never reached the group (it failed rank 0's
checks first) is replayed too, so the replicas stay in step, and the next ``Work``
covers the next ``Take``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import blake3

from epd_encoder.config import EngineConfig, SchedulerConfig
from epd_encoder.engine.scheduler import PendingEncodeItem
from epd_encoder.tp.messages import DIGEST_BYTES, Add, Call, Cancel, Take, Work, batch_digest

__all__ = ["CallLog", "RecordingScheduler", "SchedulerReplica", "served_digest", "replica_args"]

Batch = Sequence[PendingEncodeItem]


def served_digest(work_digest: bytes, batch: Batch | None) -> bytes:
    """A rank's digest of a batch: the ``Work``'s own digest, and, when the batch came from
    a replayed scheduler, that scheduler's batch (ids, parts, costs, in order)."""
    if batch is None:
        return work_digest
    h = blake3.blake3(work_digest)
    h.update(batch_digest([u.request_id for u in batch], [u.item_index for u in batch],
                          [u.cost for u in batch], [()] * len(batch)))
    return h.digest(DIGEST_BYTES)


class CallLog:
    """Rank 0's calls not yet on the wire, and the batch of its latest ``Take``.

    ``record``/``take`` come from the engine thread, ``drain`` from whichever thread holds
    the wire (the engine's ``Work`` or the heartbeat), hence the lock. ``latest()`` hands
    the latest batch to the next ``Work`` once: the replicas consume theirs the same way.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Call] = []
        self._latest: list[PendingEncodeItem] | None = None

    def record(self, call: Call) -> None:
        with self._lock:
            self._calls.append(call)

    def take(self, batch: list[PendingEncodeItem]) -> None:
        with self._lock:
            self._calls.append(Take())
            self._latest = batch

    def drain(self) -> list[Call]:
        with self._lock:
            calls, self._calls = self._calls, []
            return calls

    def latest(self) -> list[PendingEncodeItem] | None:
        with self._lock:
            batch, self._latest = self._latest, None
            return batch

    def __len__(self) -> int:
        return len(self._calls)


class RecordingScheduler:
    """The engine's scheduler on rank 0 under ``--tp N``: ``inner`` plus the ``log`` of calls."""

    def __init__(self, inner: Any, log: CallLog) -> None:
        self._inner, self._log = inner, log

    # The worker calls add(item) and next_batch(): the clock stays the inner scheduler's
    # (ReferenceScheduler has none).
    def add(self, item: PendingEncodeItem) -> None:
        self._inner.add(item)
        self._log.record(Add(item.request_id, item.item_index, item.cost))

    def next_batch(self) -> list[PendingEncodeItem]:
        batch = self._inner.next_batch()
        if batch:
            self._log.take(batch)
        return batch

    def cancel(self, request_id: str) -> int:
        n = self._inner.cancel(request_id)
        if n:  # cancelling nothing changes nothing: no call to replay
            self._log.record(Cancel(request_id))
        return n

    def __getattr__(self, name: str) -> Any:
        # Queries (pending_size, pending_cost, time_until_ready, peek_batch...) change no
        # state, so they are the inner scheduler's, unrecorded.
        return getattr(self._inner, name)


def replica_args(config: SchedulerConfig) -> dict[str, Any]:
    """What a rank needs to build the same scheduler (JSON): the scheduler section of the
    config, without the wait (rank 0 alone decides when a filling batch is due)."""
    return dataclasses.asdict(dataclasses.replace(config, max_wait_ms=0.0))


class SchedulerReplica:
    """A rank's copy of rank 0's scheduler, driven only by replayed calls."""

    def __init__(self, **config: Any) -> None:
        from epd_encoder.engine.build import build_scheduler

        self._scheduler = build_scheduler(EngineConfig(scheduler=SchedulerConfig(**config)))
        self._latest: list[PendingEncodeItem] | None = None

    def replay(self, calls: Sequence[Call]) -> None:
        s = self._scheduler
        for call in calls:
            if isinstance(call, Add):
                s.add(PendingEncodeItem(call.unit, call.part, call.cost))
            elif isinstance(call, Cancel):
                s.cancel(call.unit)
            else:
                self._latest = s.next_batch()

    def latest(self) -> list[PendingEncodeItem] | None:
        batch, self._latest = self._latest, None
        return batch

    def digest(self, work: Work, work_digest: bytes) -> bytes:
        """Replay ``work``'s calls, then this rank's digest of the batch it formed."""
        self.replay(work.calls)
        return served_digest(work_digest, self.latest())

    def pending_size(self) -> int:
        return self._scheduler.pending_size()
