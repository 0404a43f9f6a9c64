# SPDX-License-Identifier: Apache-2.0
"""Which frames of a video the Qwen video processors keep, and their timing.

Each function is the arithmetic of transformers' own code, kept operation for
operation (torch ``arange`` in float32, numpy ``linspace`` + ``round``, Python
float division in the same order), so the indices and times are the reference's
exactly, not approximately:

- ``qwen2_vl_indices``: ``Qwen2VLVideoProcessor.sample_frames`` (Qwen2-VL, Qwen2.5-VL).
- ``qwen3_vl_indices``: ``Qwen3VLVideoProcessor.sample_frames`` (Qwen3-VL, Qwen3-VL-MoE,
  Qwen3.5, Qwen3.5-MoE: transformers' auto mapping gives all four that class).
- ``pad_temporal``: the processors' ``patchify`` repeats the last frame up to a
  multiple of ``temporal_patch_size``.
- ``qwen3_vl_timestamps``: ``Qwen3VLProcessor._calculate_timestamps``, one time per
  temporal patch (the mean of its first and last frame's time).
- ``second_per_grid_ts``: ``Qwen2_5_VLProcessor`` (``temporal_patch_size /
  VideoMetadata.sampled_fps``).

``total`` is what transformers' PyAV loader takes as ``total_num_frames``: the
stream's declared frame count (``VideoHeader.frames``); ``source_fps`` its
``average_rate``. A video too short to sample raises ``InvalidInput`` where the
reference would fail with a ZeroDivisionError or ValueError. One deviation: where
``qwen2_vl_indices``' float32 step overshoots to an index equal to ``total`` (the
reference then fails with IndexError), that index is dropped.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from epd_encoder.errors import InvalidInput

__all__ = [
    "QWEN3_DEFAULT_SOURCE_FPS",
    "pad_temporal",
    "qwen2_vl_indices",
    "qwen3_vl_indices",
    "qwen3_vl_timestamps",
    "second_per_grid_ts",
]

# Qwen3VLVideoProcessor assumes 24 fps when the video's own rate is unknown.
QWEN3_DEFAULT_SOURCE_FPS = 24.0


def _check_total(total: int) -> None:
    if total <= 0:
        raise InvalidInput("the video declares no frames")


def qwen2_vl_indices(
    total: int, source_fps: float, *, fps: float, min_frames: int, max_frames: int, temporal_patch_size: int,
) -> list[int]:
    """``Qwen2VLVideoProcessor.sample_frames`` with ``fps`` sampling (``num_frames`` unset).

    The count is clamped to ``[min_frames, max_frames]`` and the video's length,
    then floored to a multiple of ``temporal_patch_size``; the indices are
    ``arange(0, total, total / count)`` in float32, truncated, and cut to ``count``.
    """
    _check_total(total)
    if not source_fps or source_fps <= 0:
        raise InvalidInput("the video's frame rate is unknown; Qwen2-VL sampling needs it")
    tps = temporal_patch_size
    max_frames = math.floor(min(max_frames, total) / tps) * tps
    num_frames = total / source_fps * fps
    num_frames = min(max(num_frames, min_frames), max_frames, total)
    num_frames = math.floor(num_frames / tps) * tps
    if num_frames <= 0:
        # The reference divides by zero here: fewer frames than one temporal patch.
        raise InvalidInput(f"sampling {total} frame(s) at fps={fps} (min_frames={min_frames}) gives fewer "
                           f"than one temporal patch of {tps}")
    # Same expression as the reference: the float32 step decides which frame each truncation lands on.
    # For some totals it yields one index more, equal to ``total`` (the reference's processor then fails
    # with IndexError): the first ``num_frames`` are the ones meant, all inside the video.
    return torch.arange(0, total, total / num_frames).int().tolist()[:num_frames]


def qwen3_vl_indices(
    total: int, source_fps: float | None, *, fps: float, min_frames: int, max_frames: int,
) -> list[int]:
    """``Qwen3VLVideoProcessor.sample_frames`` with ``fps`` sampling.

    ``int(total / source_fps * fps)`` frames clamped to ``[min_frames, max_frames]``
    and the video's length, spread by ``linspace(0, total - 1, n).round()``.
    Distinct and increasing, since ``n <= total``.
    """
    _check_total(total)
    rate = source_fps if source_fps else QWEN3_DEFAULT_SOURCE_FPS
    num_frames = int(total / rate * fps)
    num_frames = min(max(num_frames, min_frames), max_frames, total)
    return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()


def pad_temporal(indices: list[int], temporal_patch_size: int) -> list[int]:
    """The last index repeated up to a multiple of ``temporal_patch_size`` (the processors' patchify)."""
    if not indices:
        raise InvalidInput("no frames sampled")
    return list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)


def qwen3_vl_timestamps(indices: list[int], source_fps: float | None, temporal_patch_size: int) -> list[float]:
    """Seconds per temporal patch: the mean of the first and last frame time in the patch.

    ``indices`` are the sampled (unpadded) ones; the padding is the reference's.
    """
    rate = source_fps if source_fps else QWEN3_DEFAULT_SOURCE_FPS
    padded = pad_temporal(indices, temporal_patch_size)
    times = [idx / rate for idx in padded]
    m = temporal_patch_size
    return [(times[i] + times[i + m - 1]) / 2 for i in range(0, len(times), m)]


def second_per_grid_ts(sampled: int, total: int, source_fps: float | None, temporal_patch_size: int) -> float:
    """Qwen2.5-VL's seconds per temporal patch: ``T / (sampled / total * fps)``.

    ``VideoMetadata.sampled_fps`` is computed in this order; its fallback for an
    unknown rate is 24.
    """
    sampled_fps = sampled / total * source_fps if source_fps else 24
    return temporal_patch_size / sampled_fps
