# SPDX-License-Identifier: Apache-2.0
"""Qwen video preprocessing, equal to transformers' ``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``.

One class covers qwen2_vl and qwen2_5_vl (the Qwen2-VL processor: per-frame pixel
bounds) and qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe (the Qwen3-VL processor:
pixel bounds on the whole sampled clip). The work splits where the server needs it:

    header ──plan──▶ VideoPlan (indices, size, grid) ──decode_video(indices)──▶ frames
           ──stage──▶ uint8 rows [t*gh*gw, 3, T, P, P] ──finish(device)──▶ pixel_values_videos

Rows are t-major (row = (t, gh/m, gw/m, m, m)), so rows ``[a*gh*gw, b*gh*gw)`` are
temporal patches a..b-1 alone, exactly as staging only their frames would give.
Video is always transformers' torchvision arithmetic (it has no PIL video processor),
reproduced in plain torch as for images; torchvision is never imported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from epd_encoder.errors import BadAspectRatio, ConfigError, InvalidInput
from epd_encoder.preprocess import video_decode, video_sampling as vs
from epd_encoder.preprocess.base import PixelNormalizer, StagedImage
from epd_encoder.preprocess.qwen import CLIP_MEAN, CLIP_STD, MAX_ASPECT_RATIO, smart_resize
from epd_encoder.preprocess.resample import TorchResampler
from epd_encoder.preprocess.video_decode import DecodedVideo, VideoHeader, frame_groups
from epd_encoder.types import PreprocessedImage

__all__ = [
    "FAMILIES", "QwenVideoPreprocessor", "VideoBounds", "VideoOptions", "VideoPlan", "build_video_preprocessor",
]

VERSION = 1
DEFAULT_FPS = 2.0  # when the config names none (Qwen2VLVideoProcessor's fps is None): qwen-vl-utils' FPS

# model_type -> (HF video processor, what the plan's timing carries)
FAMILIES: dict[str, tuple[str, str | None]] = {
    "qwen2_vl": ("Qwen2VLVideoProcessor", None),
    "qwen2_5_vl": ("Qwen2VLVideoProcessor", "second_per_grid_ts"),
    "qwen3_vl": ("Qwen3VLVideoProcessor", "timestamps"),
    "qwen3_vl_moe": ("Qwen3VLVideoProcessor", "timestamps"),
    "qwen3_5": ("Qwen3VLVideoProcessor", "timestamps"),
    "qwen3_5_moe": ("Qwen3VLVideoProcessor", "timestamps"),
}

# The HF classes' attributes (hard-coded: importing the classes needs torchvision).
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen2VLVideoProcessor": {
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, "patch_size": 14,
        "temporal_patch_size": 2, "merge_size": 2, "min_frames": 4, "max_frames": 768, "fps": None,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "max_video_tokens": 128000,
    },
    "Qwen3VLVideoProcessor": {
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "min_frames": 4, "max_frames": 768, "fps": 2,
        "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5), "max_video_tokens": 768,
    },
}


@dataclass(frozen=True)
class VideoOptions:
    """Per-request overrides; ``None`` keeps the server's default.

    ``min_pixels``/``max_pixels`` are the processor's ``size`` bounds: per frame for
    the Qwen2-VL processor, on the sampled clip (frames x height x width) for Qwen3-VL's.
    """

    fps: float | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass(frozen=True)
class VideoBounds:
    """What requests may ask for; the config's own values must lie inside.

    ``max_frames`` caps sampled frames per video (and ``min_frames``); ``fps`` is
    the range of the sampling rate; ``pixels`` the range of min/max pixels (same
    meaning as in ``VideoOptions``), by default the config's own two values.
    """

    max_frames: int = 768
    fps: tuple[float, float] = (0.1, 8.0)
    pixels: tuple[int, int] | None = None


@dataclass(frozen=True)
class VideoPlan:
    """Everything known before a frame is decoded, from the header alone.

    ``indices`` are the frames to decode, in output order, the last repeated up to
    a multiple of the temporal patch; ``sampled`` of them are the sampler's own
    (HF's ``frames_indices``), ``total_frames`` the count they were sampled from.
    """

    indices: tuple[int, ...]
    grid_thw: tuple[int, int, int]
    num_tokens: int
    size: tuple[int, int]
    source_fps: float
    second_per_grid_ts: float | None
    timestamps: tuple[float, ...] | None
    sampled: int = 0
    total_frames: int = 0

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"frames_indices": list(self.indices[: self.sampled]), "fps": self.source_fps,
                               "total_num_frames": self.total_frames}
        if self.second_per_grid_ts is not None:
            out["second_per_grid_ts"] = self.second_per_grid_ts
        if self.timestamps is not None:
            out["timestamps"] = list(self.timestamps)
        return out

    def groups(self, start: int, stop: int) -> "VideoPlan":
        """The plan of temporal patches ``[start, stop)`` alone: the rows a chunk slices out."""
        t, gh, gw = self.grid_thw
        if not 0 <= start < stop <= t:
            raise ValueError(f"temporal patches [{start}, {stop}) outside [0, {t})")
        tps = len(self.indices) // t
        per = self.num_tokens // t
        return dataclasses.replace(
            self, indices=self.indices[start * tps: stop * tps], grid_thw=(stop - start, gh, gw),
            num_tokens=per * (stop - start), sampled=max(0, min(self.sampled - start * tps, (stop - start) * tps)),
            timestamps=None if self.timestamps is None else self.timestamps[start:stop])


def qwen3_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL video ``smart_resize``: the bounds are on frames x height x width.

    Frames smaller than ``factor`` are first scaled up (int-truncated); the budget
    uses the frame count rounded to the temporal factor, ``beta`` the exact count.
    """
    if num_frames < temporal_factor:
        raise InvalidInput(f"{num_frames} sampled frame(s); Qwen3-VL needs at least {temporal_factor}")
    source = f"{width}x{height}"
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        # Checked on the scaled-up size, as the reference; the caller knows the source's.
        ratio = max(height, width) / min(height, width)
        raise BadAspectRatio(f"video frames of {source} have aspect ratio {ratio:.1f}; the limit is "
                             f"{MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(num_frames / temporal_factor) * temporal_factor
    if t * h * w > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _strict_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name} must be an integer")
    return value


class QwenVideoPreprocessor:
    """Plans, stages and finishes one video as the family's transformers video processor."""

    def __init__(
        self, family: str, *, patch_size: int, merge_size: int, temporal_patch_size: int,
        min_pixels: int, max_pixels: int, fps: float, min_frames: int, max_frames: int,
        resample: int = Image.Resampling.BICUBIC, cap_pixels_per_frame: bool = False,
        max_video_tokens: int = 128000, normalizer: PixelNormalizer | None = None,
        bounds: VideoBounds | None = None,
    ) -> None:
        if family not in FAMILIES:
            raise ConfigError(f"no video preprocessor for model_type {family!r}")
        self.family = family
        self.processor, self.timing = FAMILIES[family]
        if min(patch_size, merge_size, temporal_patch_size) < 1:
            raise ConfigError("patch_size, merge_size and temporal_patch_size must be positive")
        self.patch_size, self.merge_size = int(patch_size), int(merge_size)
        self.temporal_patch_size = int(temporal_patch_size)
        self.factor = self.patch_size * self.merge_size
        self.resample = int(resample)
        self.resampler = TorchResampler(self.resample)
        self.cap_pixels_per_frame = bool(cap_pixels_per_frame)
        self.max_video_tokens = int(max_video_tokens)
        self.normalizer = normalizer or PixelNormalizer(image_mean=CLIP_MEAN, image_std=CLIP_STD)
        if self.normalizer.backend != "torchvision":
            raise ConfigError("video preprocessing is the torchvision arithmetic only")
        self.bounds = bounds or VideoBounds()
        lo, hi = self.bounds.pixels if self.bounds.pixels is not None else (min_pixels, max_pixels)
        f_lo, f_hi = self.bounds.fps
        if not 0 < lo <= min_pixels <= max_pixels <= hi:
            raise ConfigError(f"pixel bounds ({lo}, {hi}) must contain [{min_pixels}, {max_pixels}]")
        if not 0 < f_lo <= fps <= f_hi or not math.isfinite(f_hi):
            raise ConfigError(f"fps bounds {self.bounds.fps} must contain the default fps {fps}")
        if not 1 <= min_frames <= max_frames <= self.bounds.max_frames:
            raise ConfigError(f"need 1 <= min_frames {min_frames} <= max_frames {max_frames} <= "
                              f"bounds.max_frames {self.bounds.max_frames}")
        self.pixel_bounds = (int(lo), int(hi))
        self._default = self._make_params(float(fps), int(min_frames), int(max_frames), int(min_pixels),
                                          int(max_pixels))

    @classmethod
    def from_config(cls, video_config: Mapping[str, Any] | None, model_type: str, *,
                    bounds: VideoBounds | None = None) -> "QwenVideoPreprocessor":
        """From a ``video_preprocessor_config.json`` dict (``None``: the HF class defaults).

        Missing keys take the HF class attribute. As ``Qwen2VLVideoProcessor.__init__``,
        top-level ``min_pixels``/``max_pixels`` override ``size`` there; Qwen3-VL's
        processor reads ``size`` only. ``fps`` unset (Qwen2-VL's default) samples at 2.
        """
        if model_type not in FAMILIES:
            raise ConfigError(f"no video preprocessor for model_type {model_type!r}")
        name = FAMILIES[model_type][0]
        cfg = {**_CLASS_DEFAULTS[name], **dict(video_config or {})}
        if not cfg.get("do_resize", True):
            raise ConfigError("do_resize=false is not supported for Qwen video")
        if cfg.get("num_frames") is not None:
            raise ConfigError("fixed num_frames sampling is not supported; set fps")
        size = dict(cfg["size"] or {})
        if name == "Qwen2VLVideoProcessor":
            for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                if cfg.get(key) is not None:
                    size[edge] = cfg[key]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ConfigError(f"size needs shortest_edge and longest_edge, got {size}")
        normalizer = PixelNormalizer(
            do_rescale=cfg.get("do_rescale", True), rescale_factor=cfg.get("rescale_factor", 1 / 255),
            do_normalize=cfg.get("do_normalize", True), image_mean=cfg["image_mean"], image_std=cfg["image_std"],
            backend="torchvision")
        return cls(
            model_type, patch_size=cfg["patch_size"], merge_size=cfg["merge_size"],
            temporal_patch_size=cfg["temporal_patch_size"], min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]), fps=float(cfg["fps"] if cfg["fps"] is not None else DEFAULT_FPS),
            min_frames=cfg["min_frames"], max_frames=cfg["max_frames"],
            resample=cfg.get("resample", Image.Resampling.BICUBIC),
            cap_pixels_per_frame=bool(cfg.get("cap_pixels_per_frame")), max_video_tokens=cfg["max_video_tokens"],
            normalizer=normalizer, bounds=bounds)

    # --- parameters -------------------------------------------------------------------------------
    def _make_params(self, fps: float, min_frames: int, max_frames: int, min_pixels: int,
                     max_pixels: int) -> dict[str, Any]:
        return {
            "modality": "video", "processor": self.processor, "timing": self.timing, "version": VERSION,
            "backend": "torchvision", "patch_size": self.patch_size, "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size, "resample": self.resample,
            "fps": fps, "min_frames": min_frames, "max_frames": max_frames,
            "min_pixels": min_pixels, "max_pixels": max_pixels,
            "cap_pixels_per_frame": self.cap_pixels_per_frame,
            "max_video_tokens": self.max_video_tokens if self.cap_pixels_per_frame else None,
            **self.normalizer.params(),
        }

    def params(self) -> dict[str, Any]:
        return dict(self._default)

    def resolve(self, options: VideoOptions | None = None) -> dict[str, Any]:
        """The params one request uses; ``InvalidInput`` outside the server's bounds."""
        o = options or VideoOptions()
        d = self._default
        fps = d["fps"] if o.fps is None else o.fps
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps):
            raise InvalidInput("fps must be a finite number")
        f_lo, f_hi = self.bounds.fps
        if not f_lo <= fps <= f_hi:
            raise InvalidInput(f"fps={fps} must be within [{f_lo}, {f_hi}]")
        lo_f = _strict_int(d["min_frames"] if o.min_frames is None else o.min_frames, "min_frames")
        hi_f = _strict_int(d["max_frames"] if o.max_frames is None else o.max_frames, "max_frames")
        if not 1 <= lo_f <= hi_f <= self.bounds.max_frames:
            raise InvalidInput(f"min_frames={lo_f}, max_frames={hi_f} must satisfy "
                               f"1 <= min_frames <= max_frames <= {self.bounds.max_frames}")
        lo_p = _strict_int(d["min_pixels"] if o.min_pixels is None else o.min_pixels, "min_pixels")
        hi_p = _strict_int(d["max_pixels"] if o.max_pixels is None else o.max_pixels, "max_pixels")
        b_lo, b_hi = self.pixel_bounds
        if not b_lo <= lo_p <= hi_p <= b_hi:
            raise InvalidInput(f"min_pixels={lo_p}, max_pixels={hi_p} must satisfy "
                               f"{b_lo} <= min_pixels <= max_pixels <= {b_hi}")
        return self._make_params(float(fps), lo_f, hi_f, lo_p, hi_p)

    # --- planning ---------------------------------------------------------------------------------
    def _sample(self, total: int, rate: float, p: Mapping[str, Any]) -> list[int]:
        if self.processor == "Qwen2VLVideoProcessor":
            return vs.qwen2_vl_indices(total, rate, fps=p["fps"], min_frames=p["min_frames"],
                                       max_frames=p["max_frames"], temporal_patch_size=self.temporal_patch_size)
        return vs.qwen3_vl_indices(total, rate, fps=p["fps"], min_frames=p["min_frames"], max_frames=p["max_frames"])

    def _size(self, frames: int, height: int, width: int, p: Mapping[str, Any]) -> tuple[int, int]:
        lo, hi, f, tps = p["min_pixels"], p["max_pixels"], self.factor, self.temporal_patch_size
        if self.processor == "Qwen2VLVideoProcessor":
            if self.cap_pixels_per_frame:  # each frame's share of the clip budget (qwen-vl-utils)
                total_pixels = int(self.max_video_tokens * f * f * 0.9)
                hi = max(min(hi, total_pixels * tps // frames), int(lo * 1.05))
            return smart_resize(height, width, f, lo, hi)
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * f * f, hi // frames), int(lo * 1.05))
            hi = per_frame * frames
        return qwen3_smart_resize(frames, height, width, tps, f, lo, hi)

    def plan(self, header: VideoHeader, params: Mapping[str, Any]) -> VideoPlan:
        """Frames, size, grid and timing from the probed header; decodes nothing.

        The frame count is the declared one (what transformers' PyAV loader takes);
        a container that declares none (WebM) falls back to duration x fps.
        """
        if params.get("processor") != self.processor or params.get("modality") != "video":
            raise ValueError("params were not resolved by this video preprocessor")
        if header.width <= 0 or header.height <= 0:
            raise InvalidInput(f"video size {header.width}x{header.height} is empty")
        total = header.frames if header.frames > 0 else header.estimated_frames
        rate = header.fps
        sampled = self._sample(total, rate, params)
        indices = vs.pad_temporal(sampled, self.temporal_patch_size)
        th, tw = self._size(len(sampled), header.height, header.width, params)
        grid = (len(indices) // self.temporal_patch_size, th // self.patch_size, tw // self.patch_size)
        tokens = grid[0] * grid[1] * grid[2] // self.merge_size**2
        spg = stamps = None
        if self.timing == "second_per_grid_ts":
            spg = vs.second_per_grid_ts(len(sampled), total, rate, self.temporal_patch_size)
        elif self.timing == "timestamps":
            stamps = tuple(vs.qwen3_vl_timestamps(sampled, rate, self.temporal_patch_size))
        return VideoPlan(indices=tuple(indices), grid_thw=grid, num_tokens=tokens, size=(th, tw),
                         source_fps=rate, second_per_grid_ts=spg, timestamps=stamps, sampled=len(sampled),
                         total_frames=total)

    # --- pixels -----------------------------------------------------------------------------------
    def _resize(self, frames: torch.Tensor, th: int, tw: int) -> torch.Tensor:
        """``[n, 3, H, W]`` uint8 (a channels-last view) -> ``[n, 3, th, tw]`` uint8, as TorchResampler.

        Each frame is its own batch entry, so a batch resizes to the same values as
        frames one at a time (the reference resizes the whole clip in one call).
        """
        r = self.resampler
        if tuple(frames.shape[-2:]) == (th, tw):
            return frames
        x = frames if r.native else frames.contiguous().to(torch.float32)
        out = F.interpolate(x, size=[th, tw], mode=r.mode, align_corners=False if r.antialias else None,
                            antialias=r.antialias)
        return out if r.native else out.round_().to(torch.uint8)

    def stage(self, video: "DecodedVideo | Iterable[tuple[int, np.ndarray]]", plan: VideoPlan) -> StagedImage:
        """Resize the plan's frames and lay them out as uint8 rows ``[t*gh*gw, 3, T, P, P]``.

        Row r = (t, gh/m, gw/m, m, m), each holding ``(C, T, P, P)``: HF's patchify order.
        ``video`` is the decoded clip, or ``video_decode.stream_video``'s ``(index, frame)``
        stream: then one temporal patch of source frames is held at a time, not the clip.
        """
        (th, tw), (t, gh, gw) = plan.size, plan.grid_thw
        p, m, tps = self.patch_size, self.merge_size, self.temporal_patch_size
        if (gh * p, gw * p) != (th, tw) or t * tps != len(plan.indices):
            raise ValueError("the plan's size and grid disagree")
        out = torch.empty((t * gh * gw, 3, tps, p, p), dtype=torch.uint8)
        g = 0
        for frames in frame_groups(video, plan.indices, tps):
            for k in range(0, frames.shape[0], tps):  # one temporal patch per resize: the scratch stays small
                # The uint8 kernels return channels-last, so this HWC view is free (a reshape copies
                # only on the float path); one copy then lays the patches out.
                hwc = self._resize(frames[k:k + tps], th, tw).permute(0, 2, 3, 1)
                # (T, gh/m, m, P, gw/m, m, P, C) -> (gh/m, gw/m, m, m, C, T, P, P)
                blocks = hwc.reshape(tps, gh // m, m, p, gw // m, m, p, 3).permute(1, 4, 2, 5, 7, 0, 3, 6)
                out[g * gh * gw:(g + 1) * gh * gw].view(gh // m, gw // m, m, m, 3, tps, p, p).copy_(blocks)
                g += 1
        return StagedImage(pixels=out, grid_thw=plan.grid_thw, num_tokens=plan.num_tokens)

    def finish(self, staged: StagedImage, device: torch.device | str | None = None) -> PreprocessedImage:
        """``pixel_values_videos`` ``[rows, 3*T*P*P]`` float32: the rescale+normalize, on ``device``."""
        n = staged.pixels.shape[0]
        out = self.normalizer.apply(staged.pixels, device)
        return PreprocessedImage(pixel_values=out.reshape(n, -1), grid_thw=staged.grid_thw,
                                 num_tokens=staged.num_tokens)

    def stage_bytes(self, header: VideoHeader, plan: VideoPlan, *, streamed: bool = True) -> int:
        """Peak host bytes of decode + stage: the source frames held (streamed: one temporal
        patch and the frame being decoded; else the decoded clip, with the reordered copy
        ``decode_video`` makes when indices repeat), one temporal patch's resize scratch,
        and the staged rows."""
        frame = header.width * header.height * 3
        n, distinct = len(plan.indices), len(set(plan.indices))
        if streamed:  # one run of whole groups (frame_groups), its stacked copy, the frame being decoded
            tps = self.temporal_patch_size
            run = min(n, tps * max(1, video_decode.STREAM_RUN_BYTES // (tps * frame)))
            decoded = (2 * run + 1) * frame
        else:
            decoded = distinct * frame + (n * frame if distinct != n else 0)
        scratch = self.temporal_patch_size * header.width * header.height * (self.resampler.peak_bytes_per_pixel - 3)
        staged = n * plan.size[0] * plan.size[1] * 3
        return decoded + scratch + staged


def build_video_preprocessor(video_config: Mapping[str, Any] | None, model_type: str, *,
                             bounds: VideoBounds | None = None) -> QwenVideoPreprocessor:
    """The registry's entry point."""
    return QwenVideoPreprocessor.from_config(video_config, model_type, bounds=bounds)
