# SPDX-License-Identifier: Apache-2.0
"""The preprocessor interface, decode limits and the shared normalizer; families live beside it
and ``registry.py`` picks one by ``model_type``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from epd_encoder.errors import ConfigError
from epd_encoder.preprocess.resample import check_backend
from epd_encoder.types import PreprocessedImage

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "DecodeLimits",
    "ImagePreprocessor",
    "PixelNormalizer",
    "StagedImage",
    "StagedPreprocessor",
]


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds checked on the image header, before any pixel is decoded.

    ``max_pixels`` bounds the declared width x height (decompression bombs);
    ``max_aspect_ratio`` is long side / short side (Qwen's smart_resize allows 200).
    """

    max_bytes: int = 32 * 1024 * 1024
    max_pixels: int = 50_000_000
    max_aspect_ratio: float = 200.0

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_pixels <= 0 or self.max_aspect_ratio < 1:
            raise ConfigError(f"invalid decode limits {self}")


@dataclass(frozen=True)
class StagedImage:
    """An image resized and laid out in the tower's order, still uint8.

    ``pixels`` is ``[rows, C, P, P]`` for Qwen (temporal copies are added by
    ``finish``) and ``[tiles, C, S, S]`` for InternVL. Shipping this instead of
    fp32 pixel values moves 4x (8x with Qwen's temporal patch) fewer bytes.
    """

    pixels: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int


@runtime_checkable
class ImagePreprocessor(Protocol):
    """Turns an RGB PIL image into the tower's input, exactly as the HF processor.

    ``params()`` is the resolved, canonical, JSON-able parameter set: two
    preprocessors that can produce different pixels have different params, so
    it can be hashed into a content key. ``resolve`` validates per-request
    overrides against the server's bounds (``InvalidInput`` outside them) and
    returns the params that request will use. ``predict`` gives
    ``(grid_thw, num_tokens)`` from the upright header size alone, equal to what
    ``preprocess`` returns. ``stage`` does the CPU part (RGB step, resize,
    layout) and ``finish`` the normalization, on ``device`` when one is given
    (``None``: a CPU numpy path). ``preprocess`` is ``finish(stage(...))``.
    """

    family: str

    def params(self) -> dict[str, Any]: ...

    def resolve(self, min_pixels: int | None = None, max_pixels: int | None = None) -> dict[str, Any]: ...

    def predict(
        self, width: int, height: int, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> tuple[tuple[int, int, int], int]: ...

    def stage(
        self, image: "Image.Image", *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> StagedImage: ...

    def finish(self, staged: StagedImage, device: "torch.device | str | None" = None) -> PreprocessedImage: ...

    def stage_bytes(self, width: int, height: int, grid_thw: tuple[int, int, int]) -> int:
        """Peak host bytes of decoding and staging a ``width`` x ``height`` image with
        grid ``grid_thw`` (from ``predict``): the decoded image, the resampler's
        copies of it and the staged uint8 result. Charged before decoding."""
        ...

    def preprocess(
        self,
        image: "Image.Image",
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        device: "torch.device | str | None" = None,
    ) -> PreprocessedImage: ...


def _per_channel(value: Any, name: str) -> tuple[float, ...]:
    vals = [value] * 3 if isinstance(value, (int, float)) else list(value)
    if len(vals) != 3:
        raise ConfigError(f"{name} must have 3 channels, got {value!r}")
    # float32 rounding is what the reference computes with, so it is the canonical value.
    return tuple(float(np.float32(v)) for v in vals)


class PixelNormalizer:
    """Rescale + normalize as one uint8 -> float32 table lookup per channel.

    The table holds what the reference backend computes for each byte value, so a
    lookup is bit-identical to it. ``pil``: rescale in float64, cast, normalize in
    float32. ``torchvision``: one float32 ``(u - mean/f) / (std/f)`` with f the
    rescale factor (its fused rescale+normalize); rescale alone is ``u * f`` in float32.
    """

    def __init__(
        self,
        *,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: Any = (0.5, 0.5, 0.5),
        image_std: Any = (0.5, 0.5, 0.5),
        backend: str = "torchvision",
    ) -> None:
        self.backend = check_backend(backend)
        self.do_rescale = bool(do_rescale)
        self.rescale_factor = float(rescale_factor) if do_rescale else None
        self.do_normalize = bool(do_normalize)
        self.mean = _per_channel(image_mean, "image_mean") if do_normalize else None
        self.std = _per_channel(image_std, "image_std") if do_normalize else None
        if self.std is not None and any(s == 0 for s in self.std):
            raise ConfigError("image_std must be non-zero")
        table = self._torchvision_table() if self.backend == "torchvision" else self._pil_table()
        self.table = np.ascontiguousarray(table, dtype=np.float32)
        self._flat = torch.from_numpy(self.table.reshape(-1).copy())
        self._device_tables: dict[torch.device, torch.Tensor] = {}

    def _pil_table(self) -> np.ndarray:
        levels = np.arange(256, dtype=np.float64)
        base = (levels * self.rescale_factor).astype(np.float32) if self.do_rescale else levels.astype(np.float32)
        table = np.repeat(base[None, :], 3, axis=0)
        if self.mean is not None and self.std is not None:
            mean = np.asarray(self.mean, dtype=np.float32)[:, None]
            std = np.asarray(self.std, dtype=np.float32)[:, None]
            table = (table - mean) / std
        return table

    def _torchvision_table(self) -> np.ndarray:
        # TorchvisionBackend._fuse_mean_std_and_rescale_factor: mean and std divided by the factor.
        self._mean_t = self._std_t = None
        if self.mean is not None and self.std is not None:
            self._mean_t, self._std_t = torch.tensor(self.mean), torch.tensor(self.std)
            if self.rescale_factor is not None:
                self._mean_t = self._mean_t * (1.0 / self.rescale_factor)
                self._std_t = self._std_t * (1.0 / self.rescale_factor)
        # Without rescale and normalize the reference stays uint8; these are its values as float32.
        return self.apply_arithmetic(torch.arange(256, dtype=torch.uint8).expand(1, 3, 256))[0].numpy()

    def params(self) -> dict[str, Any]:
        return {
            "do_rescale": self.do_rescale,
            "rescale_factor": self.rescale_factor,
            "do_normalize": self.do_normalize,
            "image_mean": None if self.mean is None else list(self.mean),
            "image_std": None if self.std is None else list(self.std),
        }

    def apply_numpy(self, pixels: np.ndarray, repeat: int = 1) -> np.ndarray:
        """``[N, C, ...]`` uint8 -> ``[N, C, repeat, ...]`` float32 (repeat axis dropped if 1)."""
        n, c = pixels.shape[:2]
        rest = pixels.shape[2:]
        out = np.empty((n, c, repeat, *rest), dtype=np.float32)
        # np.take is about twice as fast into a contiguous buffer as into a strided
        # one; mode="clip" skips the bounds check that uint8 indices never need.
        scratch = np.empty((n, *rest), dtype=np.float32)
        for ch in range(c):
            np.take(self.table[ch], pixels[:, ch], out=scratch, mode="clip")
            for r in range(repeat):
                out[:, ch, r] = scratch
        return out if repeat > 1 else out.reshape(n, c, *rest)

    def apply(self, pixels: torch.Tensor, device: "torch.device | str | None", repeat: int = 1) -> torch.Tensor:
        """The lookup on ``device``; when ``device`` is None, on the CPU: for ``torchvision``
        its own float32 arithmetic (vectorized and threaded, the table's exact values),
        for ``pil`` the numpy lookup (its float64 rescale would cost a pass more)."""
        if device is None:
            if self.backend == "torchvision":
                return self.apply_arithmetic(pixels, repeat=repeat)
            return torch.from_numpy(self.apply_numpy(pixels.numpy(), repeat=repeat))
        return self.apply_torch(pixels, torch.device(device), repeat=repeat)

    def apply_arithmetic(self, pixels: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """``[N, C, ...]`` uint8 -> float32 by the torchvision backend's own ops (that backend only)."""
        if self.backend != "torchvision":
            raise ValueError("the arithmetic path reproduces the torchvision backend only")
        if self._mean_t is not None:
            view = (1, -1) + (1,) * (pixels.dim() - 2)
            out = pixels.to(torch.float32).sub_(self._mean_t.view(view)).div_(self._std_t.view(view))
        elif self.rescale_factor is not None:
            out = pixels * self.rescale_factor
        else:
            out = pixels.to(torch.float32)
        if repeat == 1:
            return out
        n, c = pixels.shape[:2]
        full = torch.empty((n, c, repeat, *pixels.shape[2:]), dtype=torch.float32)
        return full.copy_(out.unsqueeze(2).expand_as(full))

    def apply_torch(self, pixels: torch.Tensor, device: torch.device, repeat: int = 1) -> torch.Tensor:
        """The same lookup on ``device``: only uint8 crosses to it."""
        table = self._device_tables.get(device)
        if table is None:
            table = self._device_tables.setdefault(device, self._flat.to(device))
        u8 = pixels.to(device, non_blocking=True)
        n, c = u8.shape[:2]
        offsets = torch.arange(c, device=device, dtype=torch.int64).mul_(256)
        idx = u8.to(torch.int64) + offsets.view(1, c, *([1] * (u8.dim() - 2)))
        out = table[idx]
        if repeat > 1:
            out = out.unsqueeze(2).expand(n, c, repeat, *u8.shape[2:])
        return out.contiguous()


class StagedPreprocessor:
    """``preprocess`` as ``finish(stage(...))``, ``stage_bytes`` and a ``finish`` that keeps the
    staged layout (tiles, patches), shared by the preprocessors; Qwen's adds its temporal copies."""

    def finish(self, staged: StagedImage, device: "torch.device | str | None" = None) -> PreprocessedImage:
        out = self.normalizer.apply(staged.pixels, device)  # type: ignore[attr-defined]
        return PreprocessedImage(pixel_values=out, grid_thw=staged.grid_thw, num_tokens=staged.num_tokens)

    def stage_bytes(self, width: int, height: int, grid_thw: tuple[int, int, int]) -> int:
        # Staged rows (Qwen) or tiles (InternVL) hold prod(grid) uint8 patches of 3 x patch area.
        ph, pw = (self.patch_size,) * 2 if isinstance(self.patch_size, int) else self.patch_size  # type: ignore[attr-defined]
        staged = grid_thw[0] * grid_thw[1] * grid_thw[2] * 3 * ph * pw
        return width * height * self.resampler.peak_bytes_per_pixel + staged  # type: ignore[attr-defined]

    def preprocess(
        self,
        image: "Image.Image",
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        device: "torch.device | str | None" = None,
    ) -> PreprocessedImage:
        return self.finish(self.stage(image, min_pixels=min_pixels, max_pixels=max_pixels), device)
