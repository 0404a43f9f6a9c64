# SPDX-License-Identifier: Apache-2.0
"""One staged copy per content key, shared by every request that holds the key.

A key's ``Staged`` record lives from its first request's decode until the last
request holding it ends. Every duplicate that arrives meanwhile (while the key
is decoded, queued, or in the forward) joins the record: no decode and no pixels
of its own, and the engine coalesces its item onto the one flight. The staged
pixels are charged to the byte budget (``hold``) from the end of the decode until
the record ends, when they are dropped. Event-loop only, except ``let_go``.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Callable

from epd_encoder.server.budget import ByteBudget
from epd_encoder.server.executor import PixelSource
from epd_encoder.server.request_work import ItemWork, call_soon, on_loop

__all__ = ["Staged", "StagingTable"]


@dataclass(eq=False)
class Staged:
    """One key's staging: ``result`` waits for the budget then for ``job`` on the pool."""

    key: bytes
    source: PixelSource
    nbytes: int  # the predicted decode peak charged while ``job`` runs
    result: asyncio.Future | None = None
    job: Future | None = None
    waiters: int = 0  # item tasks awaiting ``result``: the last to leave abandons the job
    holders: int = 0  # requests holding the pixels, until each ends
    charged: int = 0  # staged bytes held on the budget


def staged_nbytes(staged: Any) -> int:
    pixels = getattr(staged, "pixels", None)
    return int(pixels.numel() * pixels.element_size()) if pixels is not None else 0


class StagingTable:
    """Records by key; a record is joinable while its staging has not failed and it
    is held or still staging. Invariant: ``holders >= waiters`` (an item joins, then waits)."""

    def __init__(self, pool: Executor, budget: ByteBudget) -> None:
        self._pool, self._budget = pool, budget
        self._records: dict[bytes, Staged] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def keys(self) -> set[bytes]:
        return set(self._records)

    def join(self, key: bytes, source: Callable[[], PixelSource], nbytes: int) -> Staged:
        """The key's record, opened (its staging started) if none is joinable; one holder more.
        The caller hands ``let_go`` to whatever ends with its request."""
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = Staged(key, source(), nbytes)
            record.result = asyncio.ensure_future(self._budgeted(record))
            record.result.add_done_callback(functools.partial(self._settled, record))
        record.holders += 1
        return record

    async def wait(self, record: Staged, work: ItemWork) -> PixelSource:
        """The record's source once staged. The last waiter to leave early abandons the job
        (cancelled if queued, else counted in ``work`` until it ends)."""
        assert record.result is not None
        record.waiters += 1
        try:
            await asyncio.shield(record.result)
            return record.source
        finally:
            record.waiters -= 1
            if record.waiters == 0 and not record.result.done():
                if record.job is None:  # still waiting for the budget
                    record.result.cancel()
                    self._forget(record)
                else:
                    work.abandon(record.job)
                    if record.job.cancelled():
                        self._forget(record)

    def let_go(self, loop: asyncio.AbstractEventLoop, record: Staged) -> None:
        """One holder's request ended (any thread): run on the loop."""
        on_loop(loop, self._let_go, record)

    # -- internals ---------------------------------------------------------------
    def _let_go(self, record: Staged) -> None:
        record.holders -= 1
        result, job = record.result, record.job
        if not record.holders and not record.waiters and result is not None and not result.done():
            if job is None or job.cancel():  # nobody will take it: stop a staging not yet started
                result.cancel()
                self._forget(record)
        self._close_if_idle(record)

    def _close_if_idle(self, record: Staged) -> None:
        # A staging job still running stays joinable: a new duplicate takes its result.
        if record.holders or (record.result is not None and not record.result.done()):
            return
        self._forget(record)
        if record.charged:
            self._budget.unhold(record.charged)
            record.charged = 0
        record.source.staged = None  # whoever still refers to the source holds no pixels

    def _forget(self, record: Staged) -> None:
        if self._records.get(record.key) is record:
            del self._records[record.key]

    async def _budgeted(self, record: Staged) -> None:
        """Run the stage once the budget admits its predicted peak. The decode charge is
        held until the pool job really ends (a running job cannot be stopped); the pixels
        it leaves are held from then on, while anyone holds the record."""
        await self._budget.acquire(record.nbytes)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        try:
            record.job = self._pool.submit(record.source.stage)
        except BaseException:
            self._budget.release(record.nbytes)
            raise
        record.job.add_done_callback(lambda job: call_soon(loop, self._job_ended, record, job, done))
        await done

    def _job_ended(self, record: Staged, job: Future, done: asyncio.Future) -> None:
        error = None if job.cancelled() else job.exception()
        if not job.cancelled() and error is None:
            if record.holders:
                staged = job.result()
                record.source.staged = staged
                record.charged = staged_nbytes(staged)
                self._budget.hold(record.charged)  # before the decode charge goes: never a false drain
            else:
                self._forget(record)  # nobody keeps the pixels: a later duplicate stages anew
        self._budget.release(record.nbytes)
        if done.done():
            return
        if job.cancelled():
            done.cancel()
        elif error is not None:
            done.set_exception(error)
        else:
            done.set_result(None)

    def _settled(self, record: Staged, result: asyncio.Future) -> None:
        if result.cancelled() or result.exception() is not None:  # retrieved: nobody may await it
            self._forget(record)  # a failed staging is never joined: the next request starts anew
        self._close_if_idle(record)
