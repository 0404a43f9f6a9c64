# SPDX-License-Identifier: Apache-2.0
"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL preprocessing (the Qwen2-VL image processor family)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from epd_encoder.errors import BadAspectRatio, ConfigError, InvalidInput
from epd_encoder.preprocess.base import PixelNormalizer, StagedImage, StagedPreprocessor
from epd_encoder.preprocess.decode import to_rgb
from epd_encoder.preprocess.resample import make_resampler
from epd_encoder.types import PreprocessedImage

__all__ = ["QwenPreprocessor", "build_preprocessor", "smart_resize"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``factor``, area within the bounds, aspect kept.

    Same arithmetic as transformers' ``smart_resize`` (Python's round-half-even
    included); raises ``BadAspectRatio`` beyond 200:1.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise BadAspectRatio(f"aspect ratio of {width}x{height} exceeds {MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _pixel_range(config: Mapping[str, Any]) -> tuple[int, int]:
    size = dict(config.get("size") or {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
    if config.get("min_pixels") is not None:
        size["shortest_edge"] = config["min_pixels"]
    if config.get("max_pixels") is not None:
        size["longest_edge"] = config["max_pixels"]
    lo, hi = size.get("shortest_edge"), size.get("longest_edge")
    if not lo or not hi:
        raise ConfigError(f"size needs shortest_edge and longest_edge (min/max pixels), got {size}")
    return int(lo), int(hi)


class QwenPreprocessor(StagedPreprocessor):
    family = "qwen2_vl"

    def __init__(
        self,
        *,
        patch_size: int = 14,
        merge_size: int = 2,
        temporal_patch_size: int = 2,
        min_pixels: int = 56 * 56,
        max_pixels: int = 28 * 28 * 1280,
        resample: int = Image.Resampling.BICUBIC,
        do_convert_rgb: bool = True,
        normalizer: PixelNormalizer | None = None,
        pixel_bounds: tuple[int, int] | None = None,
        backend: str = "torchvision",
    ) -> None:
        if min(patch_size, merge_size, temporal_patch_size) < 1:
            raise ConfigError("patch_size, merge_size and temporal_patch_size must be positive")
        if not 0 < min_pixels <= max_pixels:
            raise ConfigError(f"need 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
        self.patch_size = int(patch_size)
        self.merge_size = int(merge_size)
        self.temporal_patch_size = int(temporal_patch_size)
        self.factor = self.patch_size * self.merge_size
        self.min_pixels = int(min_pixels)
        self.max_pixels = int(max_pixels)
        self.resample = int(resample)
        self.do_convert_rgb = bool(do_convert_rgb)
        self.normalizer = normalizer or PixelNormalizer(image_mean=CLIP_MEAN, image_std=CLIP_STD, backend=backend)
        if self.normalizer.backend != backend:
            raise ConfigError(f"normalizer backend {self.normalizer.backend!r} differs from {backend!r}")
        self.resampler = make_resampler(backend, self.resample)
        lo, hi = pixel_bounds if pixel_bounds is not None else (self.min_pixels, self.max_pixels)
        if not 0 < lo <= self.min_pixels <= self.max_pixels <= hi:
            raise ConfigError(f"pixel_bounds {pixel_bounds} must contain [{min_pixels}, {max_pixels}]")
        self.pixel_bounds = (int(lo), int(hi))
        self._params = self._make_params(self.min_pixels, self.max_pixels)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, pixel_bounds: tuple[int, int] | None = None, backend: str = "torchvision"
    ) -> "QwenPreprocessor":
        """From a preprocessor_config.json dict, with the HF processor's defaults."""
        if not config.get("do_resize", True):
            raise ConfigError("do_resize=false is not supported for the Qwen families")
        lo, hi = _pixel_range(config)
        normalizer = PixelNormalizer(
            do_rescale=config.get("do_rescale", True),
            rescale_factor=config.get("rescale_factor", 1 / 255),
            do_normalize=config.get("do_normalize", True),
            image_mean=config.get("image_mean", CLIP_MEAN),
            image_std=config.get("image_std", CLIP_STD),
            backend=backend,
        )
        return cls(
            patch_size=config.get("patch_size", 14),
            merge_size=config.get("merge_size", 2),
            temporal_patch_size=config.get("temporal_patch_size", 2),
            min_pixels=lo,
            max_pixels=hi,
            resample=config.get("resample", Image.Resampling.BICUBIC),
            do_convert_rgb=config.get("do_convert_rgb", True),
            normalizer=normalizer,
            pixel_bounds=pixel_bounds,
            backend=backend,
        )

    def _make_params(self, min_pixels: int, max_pixels: int) -> dict[str, Any]:
        return {
            "processor": "qwen2_vl",
            "version": 1,
            "backend": self.resampler.backend,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": min_pixels,
            "max_pixels": max_pixels,
            "resample": self.resample,
            "do_convert_rgb": self.do_convert_rgb,
            **self.normalizer.params(),
        }

    def params(self) -> dict[str, Any]:
        return dict(self._params)

    def _bounds(self, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
        lo = self.min_pixels if min_pixels is None else min_pixels
        hi = self.max_pixels if max_pixels is None else max_pixels
        if isinstance(lo, bool) or isinstance(hi, bool) or not isinstance(lo, int) or not isinstance(hi, int):
            raise InvalidInput("min_pixels and max_pixels must be integers")
        b_lo, b_hi = self.pixel_bounds
        if not b_lo <= lo <= hi <= b_hi:
            raise InvalidInput(
                f"min_pixels={lo}, max_pixels={hi} must satisfy {b_lo} <= min_pixels <= max_pixels <= {b_hi}"
            )
        return lo, hi

    def resolve(self, min_pixels: int | None = None, max_pixels: int | None = None) -> dict[str, Any]:
        lo, hi = self._bounds(min_pixels, max_pixels)
        return self.params() if (lo, hi) == (self.min_pixels, self.max_pixels) else self._make_params(lo, hi)

    def _target(self, width: int, height: int, lo: int, hi: int) -> tuple[int, int]:
        if width <= 0 or height <= 0:
            raise InvalidInput(f"image size {width}x{height} is empty")
        return smart_resize(height, width, self.factor, lo, hi)

    def _grid(self, th: int, tw: int) -> tuple[tuple[int, int, int], int]:
        gh, gw = th // self.patch_size, tw // self.patch_size
        return (1, gh, gw), gh * gw // (self.merge_size**2)

    def predict(
        self, width: int, height: int, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> tuple[tuple[int, int, int], int]:
        lo, hi = self._bounds(min_pixels, max_pixels)
        return self._grid(*self._target(width, height, lo, hi))

    def stage(
        self, image: Image.Image, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> StagedImage:
        lo, hi = self._bounds(min_pixels, max_pixels)
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise InvalidInput(f"image mode {image.mode} is not RGB and do_convert_rgb is off")
        th, tw = self._target(image.width, image.height, lo, hi)
        arr = self.resampler.resize(self.resampler.prepare(image), th, tw)
        p, m = self.patch_size, self.merge_size
        gh, gw = th // p, tw // p
        # (h, w, c) -> (h/pm, w/pm, m, m, c, p, p): merge windows stay contiguous rows.
        blocks = arr.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        pixels = torch.from_numpy(np.ascontiguousarray(blocks).reshape(gh * gw, 3, p, p))
        grid, tokens = self._grid(th, tw)
        return StagedImage(pixels=pixels, grid_thw=grid, num_tokens=tokens)

    def finish(self, staged: StagedImage, device: torch.device | str | None = None) -> PreprocessedImage:
        n = staged.pixels.shape[0]
        t = self.temporal_patch_size
        out = self.normalizer.apply(staged.pixels, device, repeat=t)
        return PreprocessedImage(pixel_values=out.reshape(n, -1), grid_thw=staged.grid_thw, num_tokens=staged.num_tokens)


def build_preprocessor(
    config: Mapping[str, Any], model_config: Mapping[str, Any] | None, *,
    pixel_bounds: tuple[int, int] | None, backend: str,
) -> QwenPreprocessor:
    """The registry's entry point; the Qwen processors need nothing from config.json."""
    return QwenPreprocessor.from_config(config, pixel_bounds=pixel_bounds, backend=backend)
