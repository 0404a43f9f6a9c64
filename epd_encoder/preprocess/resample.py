# SPDX-License-Identifier: Apache-2.0
"""The two resize backends: transformers' torchvision arithmetic (plain torch) and PIL's.

transformers picks an image processor's backend by what is installed: torchvision when
it imports (every vLLM/SGLang deployment), PIL otherwise. The two resize differently,
so the backend is a setting and part of the content key. Neither imports torchvision.
"""

from __future__ import annotations

import platform
from typing import Literal, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from epd_encoder.errors import ConfigError

__all__ = ["BACKENDS", "Backend", "Resampler", "check_backend", "make_resampler"]

Backend = Literal["torchvision", "pil"]
BACKENDS: tuple[str, ...] = ("torchvision", "pil")

# transformers' pil_torch_interpolation_mapping: PIL filter -> interpolate mode.
_TORCH_MODES = {
    int(Image.Resampling.NEAREST): "nearest-exact",
    int(Image.Resampling.BILINEAR): "bilinear",
    int(Image.Resampling.BICUBIC): "bicubic",
    int(Image.Resampling.LANCZOS): "lanczos",
}


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"preprocess backend must be one of {BACKENDS}, got {backend!r}")
    return backend


class Resampler(Protocol):
    """Resizes one RGB image, possibly several times to different sizes.

    ``prepare`` converts the image once into what ``resize`` takes; ``resize``
    returns ``(height, width, 3)`` uint8 (possibly a strided view).
    """

    backend: str
    peak_bytes_per_pixel: int  # host bytes decode + stage hold at peak, per source pixel

    def prepare(self, image: Image.Image) -> object: ...

    def resize(self, source: object, height: int, width: int) -> np.ndarray: ...


class PilResampler:
    backend = "pil"
    # Decode + stage peak per source pixel, measured (VmHWM) on 3000^2 and 7000^2:
    # the RGB image (3) plus PNG decoder and resize buffers.
    peak_bytes_per_pixel = 5

    def __init__(self, resample: int) -> None:
        self.resample = int(resample)

    def prepare(self, image: Image.Image) -> Image.Image:
        return image

    def resize(self, source: Image.Image, height: int, width: int) -> np.ndarray:
        return np.asarray(source.resize((width, height), resample=self.resample))


def _native_uint8(mode: str) -> bool:
    # torchvision's _do_native_uint8_resize_on_cpu: where it is False the resize runs in
    # float32 and rounds, which is a different result, so the same rule is kept here.
    if mode != "bilinear":
        return True
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in (
        "aarch64", "arm64")


class TorchResampler:
    """``torchvision.transforms.v2.functional.resize`` on a CPU uint8 image, antialiased.

    transformers makes the image CHW-contiguous first; the uint8 kernels compute the
    same values from a channels-last view (the tests hold this on the whole corpus),
    which saves that transposing copy.
    """

    backend = "torchvision"

    def __init__(self, resample: int) -> None:
        mode = _TORCH_MODES.get(int(resample))
        if mode is None:
            raise ConfigError(f"resample={resample} has no torchvision equivalent; use --preprocess-backend pil")
        self.mode = mode
        self.antialias = mode in ("bilinear", "bicubic", "lanczos")
        self.native = mode.startswith("nearest") or _native_uint8(mode)
        # Decode + stage peak per source pixel, measured (VmHWM, 3000^2 and 7000^2): the RGB
        # image, its tensor copy and the antialias pass, 10 to 11.7; float32 adds 12.
        self.peak_bytes_per_pixel = 12 if self.native else 24

    def prepare(self, image: Image.Image) -> torch.Tensor:
        arr = np.asarray(image)  # read-only, so copied (a plain memcpy) into a tensor-owned buffer
        out = torch.empty((1, *arr.shape), dtype=torch.uint8)
        out.numpy()[0] = arr
        return out.permute(0, 3, 1, 2)

    def resize(self, source: torch.Tensor, height: int, width: int) -> np.ndarray:
        if tuple(source.shape[-2:]) == (height, width):
            out = source  # torchvision returns the input unchanged at the same size
        else:
            x = source if self.native else source.contiguous().to(torch.float32)  # the reference's layout
            align = False if self.antialias else None
            out = F.interpolate(x, size=[height, width], mode=self.mode, align_corners=align, antialias=self.antialias)
            if not self.native:  # bilinear only: it cannot overshoot, so no clamp
                out = out.round_().to(torch.uint8)
        return out[0].permute(1, 2, 0).numpy()


def make_resampler(backend: str, resample: int) -> Resampler:
    if check_backend(backend) == "pil":
        return PilResampler(resample)
    return TorchResampler(resample)
