# SPDX-License-Identifier: Apache-2.0
"""The serving executor: staged uint8 pixels in, one tower forward, metrics out."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from epd_encoder.api.metrics import Metrics
from epd_encoder.errors import EncodeFailed, EncoderError
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.preprocess.base import ImagePreprocessor, StagedImage
from epd_encoder.types import ItemOutput, PreprocessedImage


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

    @property
    def part(self) -> int:
        return 0

    def get(self) -> StagedImage:
        if self.staged is None:
            self.staged = self.stage()
        return self.staged


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


class ServingExecutor:
    """Finishes staged pixels on the device, runs one packed forward, splits, measures."""

    def __init__(self, executor: VisionExecutor, preprocessor: ImagePreprocessor,
                 metrics: Metrics, *, max_batch_cost: int) -> None:
        self._executor, self._pre, self._metrics = executor, preprocessor, metrics
        self._device = executor.device if executor.device.type != "cpu" else None
        self._budget = max_batch_cost
        # A tensor-parallel executor hashes the items' keys and costs into the batch digest every
        # rank checks, and data mode splits the batch by the costs (tp/data.py lpt_assign).
        self._costs = "costs" in inspect.signature(executor.encode).parameters

    def encode(self, payloads: Sequence[PixelSource | PartSource]) -> list[ItemOutput | BaseException]:
        start = time.perf_counter()
        outputs: list[ItemOutput | BaseException | None] = [None] * len(payloads)
        ready: list[tuple[int, Any]] = []
        for i, p in enumerate(payloads):
            self._metrics.queue_s.observe(start - p.submitted_at)
            try:
                finish = p.finish or self._pre.finish
                ready.append((i, finish(p.get(), self._device)))
            except EncoderError as e:  # a bad item fails only its own requests
                outputs[i] = e
            except Exception as e:
                outputs[i] = EncodeFailed(f"preprocessing failed: {e!r}")
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
