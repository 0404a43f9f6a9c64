# SPDX-License-Identifier: Apache-2.0
"""Kimi K2.5 preprocessing: transformers' ``Kimi_K25ImageProcessor`` (NaViT resize, pad, patchify).

transformers ships this processor for the torchvision backend only, so there is no PIL
reference to equal: ``--preprocess-backend pil`` is refused at start-up (``ConfigError``)
rather than given a meaning no aggregated deployment has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from PIL import Image

from epd_encoder.errors import ConfigError, InvalidInput
from epd_encoder.preprocess.base import PixelNormalizer, StagedImage, StagedPreprocessor
from epd_encoder.preprocess.decode import to_rgb
from epd_encoder.preprocess.resample import make_resampler

__all__ = ["KimiPreprocessor", "build_preprocessor", "navit_resize"]

IMAGENET_STANDARD = (0.5, 0.5, 0.5)
_NO_PIL = ("kimi_k25: transformers has no PIL image processor for Kimi K2.5 (Kimi_K25ImageProcessor is "
           "torchvision-only), so --preprocess-backend {!r} has no reference to equal; use torchvision")


def navit_resize(
    height: int, width: int, patch_size: int, merge_size: int, max_patches: int, max_side_patches: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((resized_h, resized_w), (padded_h, padded_w))``, transformers' arithmetic verbatim.

    Never upscales; shrinks to at most ``max_patches`` patches and ``max_side_patches``
    patches per side (``size.max_height`` counts patches); then pads bottom/right to a
    multiple of ``patch_size * merge_size``.
    """
    patches_h = max(1.0, height // patch_size)
    patches_w = max(1.0, width // patch_size)
    scale = min(
        1.0,
        math.sqrt(max_patches / (patches_h * patches_w)),
        (max_side_patches * patch_size) / height,
        (max_side_patches * patch_size) / width,
    )
    new_h = min(max(1, int(height * scale)), max_side_patches * patch_size)
    new_w = min(max(1, int(width * scale)), max_side_patches * patch_size)
    factor = merge_size * patch_size
    return (new_h, new_w), (new_h + (factor - new_h % factor) % factor, new_w + (factor - new_w % factor) % factor)


class KimiPreprocessor(StagedPreprocessor):
    family = "kimi_k25"

    def __init__(
        self,
        *,
        patch_size: int = 14,
        merge_size: int = 2,
        max_patches: int = 16384,
        max_side_patches: int = 512,
        resample: int = Image.Resampling.BICUBIC,
        do_convert_rgb: bool = True,
        normalizer: PixelNormalizer | None = None,
        backend: str = "torchvision",
    ) -> None:
        if backend != "torchvision":
            raise ConfigError(_NO_PIL.format(backend))
        if min(patch_size, merge_size, max_patches, max_side_patches) < 1:
            raise ConfigError("kimi_k25: patch_size, merge_size, max_patches and size must be positive")
        self.patch_size = int(patch_size)
        self.merge_size = int(merge_size)
        self.max_patches = int(max_patches)
        self.max_side_patches = int(max_side_patches)
        self.resample = int(resample)
        self.do_convert_rgb = bool(do_convert_rgb)
        self.normalizer = normalizer or PixelNormalizer(image_mean=IMAGENET_STANDARD, image_std=IMAGENET_STANDARD)
        self.resampler = make_resampler(backend, self.resample)
        self._params = {
            "processor": "kimi_k25",
            "version": 1,
            "backend": backend,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "max_patches": self.max_patches,
            "max_side_patches": self.max_side_patches,
            "resample": self.resample,
            "do_convert_rgb": self.do_convert_rgb,
            **self.normalizer.params(),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, backend: str = "torchvision") -> "KimiPreprocessor":
        """From a preprocessor_config.json dict, with ``Kimi_K25ImageProcessor``'s class defaults."""
        if backend != "torchvision":
            raise ConfigError(_NO_PIL.format(backend))
        if not config.get("do_resize", True):
            raise ConfigError("kimi_k25: do_resize=false is not supported")
        size = config.get("size") or {"max_height": 512, "max_width": 512}
        if not isinstance(size, Mapping) or not size.get("max_height") or size.get("max_height") != size.get("max_width"):
            raise ConfigError(f"kimi_k25: size must give equal max_height and max_width, got {size!r}")
        normalizer = PixelNormalizer(
            do_rescale=config.get("do_rescale", True),
            rescale_factor=config.get("rescale_factor", 1 / 255),
            do_normalize=config.get("do_normalize", True),
            image_mean=config.get("image_mean", IMAGENET_STANDARD),
            image_std=config.get("image_std", IMAGENET_STANDARD),
            backend=backend,
        )
        return cls(
            patch_size=config.get("patch_size", 14),
            merge_size=config.get("merge_size", 2),
            max_patches=config.get("max_patches", 16384),
            max_side_patches=int(size["max_height"]),
            resample=config.get("resample", Image.Resampling.BICUBIC),
            do_convert_rgb=config.get("do_convert_rgb", True),
            normalizer=normalizer,
            backend=backend,
        )

    def params(self) -> dict[str, Any]:
        return dict(self._params)

    def resolve(self, min_pixels: int | None = None, max_pixels: int | None = None) -> dict[str, Any]:
        if min_pixels is not None or max_pixels is not None:
            raise InvalidInput("min_pixels/max_pixels overrides are not supported for Kimi K2.5")
        return self.params()

    def _sizes(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        if width <= 0 or height <= 0:
            raise InvalidInput(f"image size {width}x{height} is empty")
        return navit_resize(height, width, self.patch_size, self.merge_size, self.max_patches, self.max_side_patches)

    def _grid(self, padded: tuple[int, int]) -> tuple[tuple[int, int, int], int]:
        gh, gw = padded[0] // self.patch_size, padded[1] // self.patch_size
        return (1, gh, gw), gh * gw // self.merge_size**2

    def predict(
        self, width: int, height: int, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> tuple[tuple[int, int, int], int]:
        self.resolve(min_pixels, max_pixels)
        return self._grid(self._sizes(width, height)[1])

    def stage(
        self, image: Image.Image, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> StagedImage:
        self.resolve(min_pixels, max_pixels)
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise InvalidInput(f"image mode {image.mode} is not RGB and do_convert_rgb is off")
        (th, tw), (ph, pw) = self._sizes(image.width, image.height)
        resized = self.resampler.resize(self.resampler.prepare(image), th, tw)
        p = self.patch_size
        grid, tokens = self._grid((ph, pw))
        gh, gw = grid[1], grid[2]
        # Padding is zeros at the bottom and right, before normalization (as the reference).
        canvas = torch.zeros((ph, pw, 3), dtype=torch.uint8)
        canvas.numpy()[:th, :tw] = resized
        # (h, w, c) -> (gh, gw, c, p, p): raster patch order, channels first in each patch.
        pixels = canvas.view(gh, p, gw, p, 3).permute(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
        return StagedImage(pixels=pixels, grid_thw=grid, num_tokens=tokens)


def build_preprocessor(
    config: Mapping[str, Any], model_config: Mapping[str, Any] | None, *,
    pixel_bounds: tuple[int, int] | None, backend: str,
) -> KimiPreprocessor:
    """The registry's entry point; Kimi's NaViT budget takes no per-request pixel bounds."""
    if pixel_bounds is not None:
        raise ConfigError("pixel_bounds apply to the Qwen families only")
    return KimiPreprocessor.from_config(config, backend=backend)
