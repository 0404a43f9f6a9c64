# SPDX-License-Identifier: Apache-2.0
"""The serving executor: staged uint8 pixels in, one tower forward, metrics out."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from epd_encoder.api.metrics import Metrics
from epd_encoder.errors import EncodeFailed, EncoderError
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.preprocess.base import ImagePreprocessor, StagedImage
from epd_encoder.types import ItemOutput, PreprocessedImage

log = logging.getLogger(__name__)


@dataclass
class PixelSource:
    """An item's tower input: staged up front, or staged lazily on the engine thread.

    The front skips preprocessing for keys it finds cached. If such an entry is
    evicted before the worker looks, the worker schedules it and ``stage``
    (decode + resize from the retained bytes) runs here instead: slower, never wrong.
    """

    staged: StagedImage | None
    stage: Callable[[], StagedImage]
    cost: int
    finish: Callable[..., PreprocessedImage] | None = None  # None: the executor's image preprocessor
    submitted_at: float = field(default_factory=time.perf_counter)
    key: bytes = b""  # the content key: names the item in a tensor-parallel batch digest
    # The prefetch thread and the engine thread may both need the lazy stage: it runs once.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def part(self) -> int:
        return 0

    def get(self) -> StagedImage:
        staged = self.staged
        if staged is None:
            with self._lock:
                if self.staged is None:
                    self.staged = self.stage()
                staged = self.staged
        return staged


@dataclass
class PartSource:
    """Temporal groups ``[start, stop)`` of a video: rows are t-major, so a chunk is the
    row slice of those groups with grid ``(stop - start, h, w)``. Parts share their
    whole's staged pixels (staged once, on first use)."""

    whole: PixelSource
    start: int
    stop: int
    cost: int

    @property
    def finish(self) -> Callable[..., PreprocessedImage] | None:
        return self.whole.finish

    @property
    def submitted_at(self) -> float:
        return self.whole.submitted_at

    @property
    def key(self) -> bytes:
        return self.whole.key

    @property
    def part(self) -> int:
        return self.start

    def get(self) -> StagedImage:
        s = self.whole.get()
        t, h, w = s.grid_thw
        if not 0 <= self.start < self.stop <= t or s.num_tokens % t:
            raise EncodeFailed(f"part [{self.start}, {self.stop}) does not fit grid {s.grid_thw}")
        frame = s.pixels.shape[0] // t
        return StagedImage(s.pixels[self.start * frame:self.stop * frame], (self.stop - self.start, h, w),
                           s.num_tokens // t * (self.stop - self.start))


class HeldBytes(Protocol):
    """Where host bytes held for queued work are charged (the front's ``ByteBudget``)."""

    def hold(self, n: int) -> None: ...
    def unhold(self, n: int) -> None: ...


def _nbytes(item: Any) -> int:
    pixels = getattr(item, "pixel_values", None)
    return int(pixels.numel() * pixels.element_size()) if pixels is not None else 0


class _FinishJob:
    """One prefetched batch: finished inputs by payload identity, filled in order by the
    prefetch thread, each charged to ``held`` from its finish until ``close``. The job
    holds its payloads, so their ``id``s stay unique while it lives."""

    def __init__(self, payloads: Sequence[Any], finish: Callable[[Any], Any],
                 held: HeldBytes | None = None) -> None:
        self._finish, self._held = finish, held
        self.items: dict[int, tuple[Any, Future]] = {id(p): (p, Future()) for p in payloads}
        self._lock = threading.Lock()  # ``close`` (engine thread) against charges (prefetch thread)
        self._closed, self.charged = False, 0

    def run(self) -> None:  # on the prefetch thread
        for payload, fut in list(self.items.values()):
            if not fut.set_running_or_notify_cancel():
                continue  # dropped before its turn
            try:
                out = self._finish(payload)
            except BaseException as e:  # surfaces as that item's error when taken
                fut.set_exception(e)
                continue
            with self._lock:
                if not self._closed and self._held is not None:
                    n = _nbytes(out)
                    self.charged += n
                    self._held.hold(n)
            fut.set_result(out)

    def take(self, payload: Any) -> Future | None:
        entry = self.items.get(id(payload))
        return entry[1] if entry is not None and entry[0] is payload else None

    def close(self) -> None:
        """Skip what has not started, drop what has finished and give its charge back:
        what a forward took is the forward's now."""
        with self._lock:
            self._closed, charged, self.charged = True, self.charged, 0
        for _, fut in self.items.values():
            fut.cancel()
        self.items = {}
        if charged and self._held is not None:
            self._held.unhold(charged)


class _FinishThread:
    """The one side thread that runs prefetch jobs, started on first use."""

    def __init__(self, name: str = "epd-prefetch") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: _FinishJob) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()


class ServingExecutor:
    """Finishes staged pixels on the device, runs one packed forward, splits, measures.

    With ``prefetch`` (CPU only; docs/engine.md), the finish of the batch the worker
    previews as next runs on a side thread while this batch's forward runs: one
    prefetched batch at most, taken by payload identity, finished again on a wrong guess.
    """

    def __init__(self, executor: VisionExecutor, preprocessor: ImagePreprocessor,
                 metrics: Metrics, *, max_batch_cost: int, prefetch: bool = True,
                 held: HeldBytes | None = None) -> None:
        self._executor, self._pre, self._metrics = executor, preprocessor, metrics
        # The prefetched batch's fp32 inputs are charged here while they wait (the runtime
        # sets the front's budget once both exist).
        self.held = held
        self._device = executor.device if executor.device.type != "cpu" else None
        self._budget = max_batch_cost
        # A tensor-parallel executor hashes the items' keys and costs into the batch digest every
        # rank checks, and data mode splits the batch by the costs (tp/data.py lpt_assign).
        self._costs = "costs" in inspect.signature(executor.encode).parameters
        # A device finish would queue on the forward's stream from another thread: no overlap
        # without pinned staging and a side stream, so it stays in line there (docs/engine.md).
        self._prefetching = prefetch and self._device is None
        # On a device only the staged uint8 crosses, through the executor's upload (pinned memory,
        # a side copy stream: batch N+1's copy runs beside batch N's kernels); finish then runs there.
        self._upload: Callable[[Any], Any] | None = (getattr(executor, "upload", None)
                                                     if self._device is not None else None)
        self._side = _FinishThread()
        self._job: _FinishJob | None = None  # started during the last forward, for the next encode
        self._next: list[Any] = []  # the preview given by prefetch(), started by the next encode
        self.prefetched = 0  # items whose finish came from a prefetch (benchmarks, tests)

    # -- prefetch (engine thread) ------------------------------------------------
    def prefetch(self, payloads: Sequence[PixelSource | PartSource]) -> None:
        if self._prefetching:
            self._next = list(payloads)

    def drop_prefetch(self, *, stop: bool = False) -> None:
        self._next = []
        job, self._job = self._job, None
        if job is not None:
            job.close()
        if stop:
            self._side.stop()

    @property
    def prefetch_thread_alive(self) -> bool:
        return self._side.alive

    def _finish(self, p: PixelSource | PartSource) -> PreprocessedImage:
        staged = p.get()
        if self._upload is not None and staged.pixels.device.type == "cpu":
            staged = dataclasses.replace(staged, pixels=self._upload(staged.pixels))
        return (p.finish or self._pre.finish)(staged, self._device)

    def _start_prefetch(self, batch: Sequence[Any]) -> None:
        # Started once this batch's inputs are ready, so the two never compete and at most
        # one finished batch waits beside the one in the forward.
        taken = {id(p) for p in batch}
        nxt = [p for p in self._next if id(p) not in taken]
        self._next = []
        if nxt:
            self._job = _FinishJob(nxt, self._finish, self.held)
            self._side.submit(self._job)

    def encode(self, payloads: Sequence[PixelSource | PartSource]) -> list[ItemOutput | BaseException]:
        start = time.perf_counter()
        job, self._job = self._job, None
        outputs: list[ItemOutput | BaseException | None] = [None] * len(payloads)
        ready: list[tuple[int, Any]] = []
        for i, p in enumerate(payloads):
            self._metrics.queue_s.observe(start - p.submitted_at)
            fut = job.take(p) if job is not None else None
            try:
                if fut is not None and not fut.cancelled():
                    ready.append((i, fut.result()))  # waits if the side thread is on it
                    self.prefetched += 1
                else:
                    ready.append((i, self._finish(p)))
            except EncoderError as e:  # a bad item fails only its own requests
                outputs[i] = e
            except Exception as e:
                outputs[i] = EncodeFailed(f"preprocessing failed: {e!r}")
        if job is not None:
            job.close()  # what this batch did not take was a wrong guess
        if self._prefetching:
            self._start_prefetch(payloads)
        if ready:
            t0 = time.perf_counter()
            items = [item for _, item in ready]
            if self._costs:
                tp_encode: Callable[..., list[ItemOutput]] = self._executor.encode  # tp/data.py, tp/weights.py
                # Every rank hashes which item (content key, first temporal group) at what cost.
                results = tp_encode(items, keys=[(payloads[i].key.hex(), payloads[i].part) for i, _ in ready],
                                    costs=[max(1, int(payloads[i].cost)) for i, _ in ready])
            else:
                results = self._executor.encode(items)
            self._metrics.forward_s.observe(time.perf_counter() - t0)
            for (i, _), out in zip(ready, results):
                outputs[i] = out
        self._metrics.batch_size.observe(len(payloads))
        self._metrics.batch_fill.observe(sum(p.cost for p in payloads) / self._budget)
        return outputs  # type: ignore[return-value]
