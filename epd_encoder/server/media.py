# SPDX-License-Identifier: Apache-2.0
"""Per-modality steps of the front: byte limit, request params, header probe, staging.

The front runs the same path for every item (bytes, key, probe, cache, stage); what
differs between an image and a video is here. ``inspect`` runs on the preprocessing
pool and reads headers only: it returns everything the item costs and will say (grid,
tokens, metadata, host bytes) before any pixel is decoded, plus the ``stage`` job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from epd_encoder.api.metrics import Metrics
from epd_encoder.preprocess.base import DecodeLimits, ImagePreprocessor, StagedImage
from epd_encoder.preprocess.decode import decode_image, probe_image
from epd_encoder.types import PreprocessedImage


@dataclass(frozen=True)
class Inspected:
    grid_thw: tuple[int, int, int]
    num_tokens: int
    nbytes: int  # predicted host peak of ``stage``
    stage: Callable[[], StagedImage]
    meta: dict | None = None  # video timing (api/schemas.py VideoInfo)


class Media(Protocol):
    modality: str
    max_bytes: int
    too_large: type[Exception]

    def resolve(self, body: Any) -> tuple[dict, Any]:
        """``(params for the content key, options for inspect)`` of one request."""
        ...

    def inspect(self, data: bytes, options: Any) -> Inspected: ...

    def finish(self, staged: StagedImage, device: Any = None) -> PreprocessedImage: ...


def _timed(metrics: Metrics, fn: Callable[[], StagedImage]) -> Callable[[], StagedImage]:
    def run() -> StagedImage:
        t0 = time.perf_counter()
        staged = fn()
        metrics.preprocess_s.observe(time.perf_counter() - t0)
        return staged

    return run


class ImageMedia:
    modality = "image"

    def __init__(self, pre: ImagePreprocessor, limits: DecodeLimits, metrics: Metrics) -> None:
        from epd_encoder.errors import ImageTooLarge

        self.pre, self.limits, self.metrics = pre, limits, metrics
        self.max_bytes, self.too_large = limits.max_bytes, ImageTooLarge

    def resolve(self, body: Any) -> tuple[dict, Any]:
        overrides = dict(min_pixels=body.min_pixels, max_pixels=body.max_pixels)
        return self.pre.resolve(**overrides), overrides

    def inspect(self, data: bytes, overrides: dict) -> Inspected:
        header = probe_image(data, self.limits)
        grid, tokens = self.pre.predict(header.width, header.height, **overrides)
        stage = _timed(self.metrics, lambda: self.pre.stage(decode_image(data, self.limits), **overrides))
        return Inspected(grid, tokens, self.pre.stage_bytes(header.width, header.height, grid), stage)

    def finish(self, staged: StagedImage, device: Any = None) -> PreprocessedImage:
        return self.pre.finish(staged, device)


class VideoMedia:
    """Videos of the Qwen families: sampled, resized and patchified as transformers'
    video processor does (preprocess/video.py), decoded under ``VideoLimits``."""

    modality = "video"

    def __init__(self, pre: Any, limits: Any, metrics: Metrics) -> None:
        from epd_encoder.errors import VideoTooLarge

        self.pre, self.limits, self.metrics = pre, limits, metrics
        self.max_bytes, self.too_large = limits.max_bytes, VideoTooLarge

    def resolve(self, body: Any) -> tuple[dict, Any]:
        from epd_encoder.preprocess.video import VideoOptions

        params = self.pre.resolve(VideoOptions(**body.video_options.model_dump()))
        return params, params

    def inspect(self, data: bytes, params: dict) -> Inspected:
        from epd_encoder.preprocess.video_decode import probe_video, stream_video

        header = probe_video(data, self.limits)
        plan = self.pre.plan(header, params)
        # Streamed: frames are resized as they are decoded, one temporal patch held at a time.
        stage = _timed(self.metrics, lambda: self.pre.stage(stream_video(data, self.limits, plan.indices), plan))
        return Inspected(plan.grid_thw, plan.num_tokens, self.pre.stage_bytes(header, plan), stage,
                         plan.metadata())

    def finish(self, staged: StagedImage, device: Any = None) -> PreprocessedImage:
        return self.pre.finish(staged, device)
