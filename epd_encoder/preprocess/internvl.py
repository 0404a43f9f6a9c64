# SPDX-License-Identifier: Apache-2.0
"""InternVL (transformers' ``internvl``) preprocessing: the GotOcr2 tiling processor."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import torch
from PIL import Image

from epd_encoder.errors import ConfigError, InvalidInput
from epd_encoder.preprocess.base import PixelNormalizer, StagedImage, StagedPreprocessor
from epd_encoder.types import PreprocessedImage
from epd_encoder.preprocess.decode import to_rgb
from epd_encoder.preprocess.resample import make_resampler

__all__ = ["InternVLPreprocessor", "build_preprocessor", "tile_grid"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@lru_cache(maxsize=256)
def tile_grid(height: int, width: int, tile_h: int, tile_w: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """``(columns, rows)`` of the tile canvas whose aspect is closest to the image's.

    Candidates are ordered by tile count; on an aspect tie the larger canvas
    wins while the image area exceeds half of it (GotOcr2's rule).
    """
    candidates = sorted(
        ((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if min_tiles <= c * r <= max_tiles),
        key=lambda g: g[0] * g[1],
    )
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in candidates:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile_h * tile_w * cols * rows:
            best = (cols, rows)
    return best


def exact_arithmetic(norm: PixelNormalizer) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """float32 ops that give ``norm``'s table on every byte value of every channel, hence
    bitwise its lookup on any image; None if no candidate does.

    The PIL reference rescales in float64 and rounds to float32; one float32 multiply or
    divide by the factor usually lands on the same values, which the probe checks.
    """
    if norm.backend != "pil":
        return None
    f = norm.rescale_factor
    scales: list[Callable[[torch.Tensor], torch.Tensor]] = [lambda x: x]
    if f is not None:
        scales = [lambda x: x.mul_(f), lambda x: x.div_(1.0 / f)]
    mean = None if norm.mean is None else torch.tensor(norm.mean, dtype=torch.float32)
    std = None if norm.std is None else torch.tensor(norm.std, dtype=torch.float32)
    probe = torch.arange(256, dtype=torch.uint8).expand(1, 3, 256)
    want = torch.from_numpy(norm.table).view(torch.int32)
    for scale in scales:
        def apply(u8: torch.Tensor, scale=scale) -> torch.Tensor:
            x = scale(u8.to(torch.float32))
            if mean is None or std is None:
                return x
            view = (1, -1) + (1,) * (u8.dim() - 2)
            return x.sub_(mean.view(view)).div_(std.view(view))

        if torch.equal(apply(probe)[0].view(torch.int32), want):
            return apply
    return None


def _pair(value: Any, name: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    raise ConfigError(f"{name} must be an int or a pair, got {value!r}")


class InternVLPreprocessor(StagedPreprocessor):
    # Constructor defaults are InternVL3's checkpoint values; from_config falls
    # back to the HF GotOcr2 class defaults for keys a config omits.
    family = "internvl"

    def __init__(
        self,
        *,
        tile_size: tuple[int, int] = (448, 448),
        crop_to_patches: bool = True,
        min_patches: int = 1,
        max_patches: int = 12,
        resample: int = Image.Resampling.BICUBIC,
        do_convert_rgb: bool = True,
        normalizer: PixelNormalizer | None = None,
        patch_size: tuple[int, int] = (14, 14),
        downsample_ratio: float = 0.5,
        backend: str = "torchvision",
    ) -> None:
        th, tw = tile_size
        ph, pw = patch_size
        if th <= 0 or tw <= 0 or th % ph or tw % pw:
            raise ConfigError(f"tile size {tile_size} must be a positive multiple of the patch size {patch_size}")
        rows_per_tile, cols_per_tile = th // ph * downsample_ratio, tw // pw * downsample_ratio
        if not (rows_per_tile.is_integer() and cols_per_tile.is_integer()) or rows_per_tile <= 0:
            raise ConfigError(f"downsample_ratio {downsample_ratio} does not divide the {th // ph}x{tw // pw} patch grid")
        self.tile_size = (int(th), int(tw))
        self.crop_to_patches = bool(crop_to_patches)
        self.min_patches = int(min_patches)
        self.max_patches = int(max_patches)
        self.resample = int(resample)
        self.do_convert_rgb = bool(do_convert_rgb)
        self.normalizer = normalizer or PixelNormalizer(
            image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD, backend=backend)
        if self.normalizer.backend != backend:
            raise ConfigError(f"normalizer backend {self.normalizer.backend!r} differs from {backend!r}")
        self.resampler = make_resampler(backend, self.resample)
        self._exact = exact_arithmetic(self.normalizer)
        self.patch_size = (int(ph), int(pw))
        self.tokens_per_tile = int(rows_per_tile) * int(cols_per_tile)
        self._params = {
            "processor": "got_ocr2",
            "version": 1,
            "backend": backend,
            "tile_size": list(self.tile_size),
            "tiling": self._tiling,
            "min_patches": self.min_patches if self._tiling else None,
            "max_patches": self.max_patches if self._tiling else None,
            "resample": self.resample,
            "do_convert_rgb": self.do_convert_rgb,
            **self.normalizer.params(),
        }

    @property
    def _tiling(self) -> bool:
        return self.crop_to_patches and self.max_patches > 1

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], model_config: Mapping[str, Any] | None = None, *, backend: str = "torchvision"
    ) -> "InternVLPreprocessor":
        """From a preprocessor_config.json dict (GotOcr2 defaults) and the model's config.json."""
        size = config.get("size") or {"height": 384, "width": 384}
        if not isinstance(size, Mapping) or not size.get("height") or not size.get("width"):
            raise ConfigError(f"size must give height and width, got {size!r}")
        crop = bool(config.get("crop_to_patches", False))
        if not crop and not config.get("do_resize", True):
            raise ConfigError("do_resize=false is not supported for InternVL")
        vision = dict((model_config or {}).get("vision_config") or {})
        normalizer = PixelNormalizer(
            do_rescale=config.get("do_rescale", True),
            rescale_factor=config.get("rescale_factor", 1 / 255),
            do_normalize=config.get("do_normalize", True),
            image_mean=config.get("image_mean", CLIP_MEAN),
            image_std=config.get("image_std", CLIP_STD),
            backend=backend,
        )
        return cls(
            tile_size=(int(size["height"]), int(size["width"])),
            crop_to_patches=crop,
            min_patches=config.get("min_patches", 1),
            max_patches=config.get("max_patches", 12),
            resample=config.get("resample", Image.Resampling.BICUBIC),
            do_convert_rgb=config.get("do_convert_rgb", True),
            normalizer=normalizer,
            patch_size=_pair(vision.get("patch_size", 14), "vision_config.patch_size"),
            downsample_ratio=float((model_config or {}).get("downsample_ratio", 0.5)),
            backend=backend,
        )

    def params(self) -> dict[str, Any]:
        return dict(self._params)

    def resolve(self, min_pixels: int | None = None, max_pixels: int | None = None) -> dict[str, Any]:
        if min_pixels is not None or max_pixels is not None:
            raise InvalidInput("min_pixels/max_pixels overrides are not supported for InternVL")
        return self.params()

    def finish(self, staged: StagedImage, device: torch.device | str | None = None) -> PreprocessedImage:
        # PIL backend on the CPU: vectorized float32 ops instead of the table lookup, when
        # exact_arithmetic proved them equal (40% of the lookup's time on 448² tiles).
        if device is not None or self._exact is None:
            return super().finish(staged, device)
        return PreprocessedImage(self._exact(staged.pixels), staged.grid_thw, staged.num_tokens)

    def _layout(self, width: int, height: int) -> tuple[int, int]:
        if width <= 0 or height <= 0:
            raise InvalidInput(f"image size {width}x{height} is empty")
        if not self._tiling:
            return 1, 1
        th, tw = self.tile_size
        return tile_grid(height, width, th, tw, self.min_patches, self.max_patches)

    def _grid(self, tiles: int) -> tuple[tuple[int, int, int], int]:
        th, tw = self.tile_size
        ph, pw = self.patch_size
        return (tiles, th // ph, tw // pw), tiles * self.tokens_per_tile

    @staticmethod
    def _count(cols: int, rows: int) -> int:
        return cols * rows + (1 if cols * rows > 1 else 0)

    def predict(
        self, width: int, height: int, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> tuple[tuple[int, int, int], int]:
        self.resolve(min_pixels, max_pixels)
        return self._grid(self._count(*self._layout(width, height)))

    def stage(
        self, image: Image.Image, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> StagedImage:
        self.resolve(min_pixels, max_pixels)
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise InvalidInput(f"image mode {image.mode} is not RGB and do_convert_rgb is off")
        cols, rows = self._layout(image.width, image.height)
        th, tw = self.tile_size
        source = self.resampler.prepare(image)
        canvas = self.resampler.resize(source, th * rows, tw * cols)
        grid, tokens = self._grid(self._count(cols, rows))
        tiles = torch.empty((grid[0], 3, th, tw), dtype=torch.uint8)
        out = tiles.numpy()  # one buffer: tiles in row-major order, then the thumbnail
        out[: rows * cols].reshape(rows, cols, 3, th, tw)[...] = canvas.reshape(rows, th, cols, tw, 3).transpose(
            0, 2, 4, 1, 3)
        if rows * cols > 1:
            out[-1] = self.resampler.resize(source, th, tw).transpose(2, 0, 1)
        return StagedImage(pixels=tiles, grid_thw=grid, num_tokens=tokens)


def build_preprocessor(
    config: Mapping[str, Any], model_config: Mapping[str, Any] | None, *,
    pixel_bounds: tuple[int, int] | None, backend: str,
) -> InternVLPreprocessor:
    """The registry's entry point; InternVL's tiling takes no per-request pixel bounds."""
    if pixel_bounds is not None:
        raise ConfigError("pixel_bounds apply to the Qwen families only")
    return InternVLPreprocessor.from_config(config, model_config, backend=backend)
