# SPDX-License-Identifier: Apache-2.0
"""What is served and what one item may be: the model, image limits, video limits."""

from __future__ import annotations
import re
from dataclasses import dataclass
from typing import Literal

from epd_encoder.config.base import MiB, opt, _positive


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = opt(
        None,
        "Checkpoint: a local directory, or a Hugging Face Hub id (org/name) resolved through "
        "the Hub cache (HF_HUB_OFFLINE=1: cache only). From the Hub only config.json, the "
        "processor configs, the safetensors index and the shards holding vision tensors are "
        "downloaded (a 7B VLM costs its 1-2 GB vision shards, not 16 GB); a single-file "
        "model.safetensors is downloaded whole. Without it the built-in tiny model is served.",
    )
    revision: str | None = opt(
        None, "Hub revision (branch, tag or commit) of a Hub --model; default: main. Not "
        "allowed with a local directory.",
    )
    model_id: str | None = opt(
        None, "Name reported in responses; default: the directory name or the Hub id. Not part "
        "of content keys (those hash the configs and vision weights, see docs/models.md).",
    )
    device: str = opt(
        "auto", "Device for the tower: 'auto' picks cuda when present, else cpu; 'cuda' or "
        "'cuda:N' fail at start-up when that GPU is absent.", metavar="{auto,cpu,cuda,cuda:N}",
    )
    tower: Literal["fast", "reference"] = opt(
        "fast",
        "Vision forward: 'fast' is our packed implementation (equal to transformers within "
        "~1e-7); 'reference' runs transformers' own module, slower, and bitwise equal to it "
        "for an item encoded alone (a packed batch moves the last bits; see --batch-invariant).",
    )
    batch_invariant: bool = opt(
        False,
        "Encode each image/video/tile alone within a batch, so its embedding is bitwise the "
        "same whatever it is batched with, cache hits included (at a fixed thread count). "
        "With --tower reference, a prefill reproduces the aggregated model's logits exactly "
        "when that model runs under epd_encoder.models.invariant.batch_invariant. Costs the "
        "packing gain: about 1.1x the forward time on CPU, more on GPU for small images.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "Tower dtype: 'auto' is bfloat16 on CUDA and float32 on CPU."
    )
    preprocess_backend: Literal["torchvision", "pil"] = opt(
        "torchvision",
        "Which transformers image-processor backend the pixels equal bit for bit: "
        "'torchvision' is what transformers picks wherever torchvision is installed (every "
        "vLLM/SGLang deployment); 'pil' is its fallback without it. They resize differently "
        "(pixel_values differ by up to ~0.3), so pick the one the aggregated setup you "
        "compare with runs. Part of the content key. Neither imports torchvision.",
    )

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.revision is not None and self.model is None:
            raise ValueError("--revision needs --model (a Hub id)")


@dataclass(frozen=True)
class LimitsConfig:
    max_items: int = opt(
        64, "Most images per request (413 beyond). Bounds one request's share of the queue."
    )
    max_image_bytes: int = opt(
        32 * MiB, "Largest encoded image accepted, in bytes (413 beyond), checked before decoding."
    )
    max_image_pixels: int = opt(
        50_000_000,
        "Largest declared width x height (413 beyond), read from the header before decoding: "
        "the decompression-bomb guard.",
    )
    max_aspect_ratio: float = opt(
        200.0, "Largest long/short side ratio (400 beyond); Qwen's smart_resize allows 200."
    )
    min_pixels_floor: int | None = opt(
        None, "Lowest per-request min_pixels override allowed; default: the checkpoint's own."
    )
    max_pixels_ceiling: int | None = opt(
        None, "Highest per-request max_pixels override allowed; default: the checkpoint's own."
    )
    max_decoded_mb: int = opt(
        1024,
        "Host MiB that images being decoded and staged may hold at once, across requests, "
        "predicted from each header before decoding (about 12 bytes per source pixel with the "
        "torchvision backend, 5 with pil). Beyond it items wait their turn, in arrival order, "
        "within the request timeout; one image bigger than the whole budget runs alone. Lower "
        "bounds peak RSS; too low serializes decoding of large images.",
    )

    def __post_init__(self) -> None:
        _positive(self, "max_items", "max_image_bytes", "max_image_pixels", "max_aspect_ratio",
                  "max_decoded_mb")


@dataclass(frozen=True)
class VideoConfig:
    """Video input: bounds checked on the container header, and again while decoding."""

    max_video_bytes: int = opt(
        64 * MiB, "Largest encoded video accepted, in bytes (413 beyond). The body limit "
        "(--max-body-mb) also applies, to the base64 text.",
    )
    max_video_seconds: float = opt(
        1800.0, "Longest video accepted, in seconds of declared or decoded duration (413 beyond).",
    )
    max_video_frame_pixels: int = opt(
        3840 * 2160, "Largest frame, width x height (413 beyond): 4K UHD by default.",
    )
    max_video_decoded_frames: int = opt(
        54_000, "Most frames a video may declare or decode (413 beyond): 30 minutes at 30 fps.",
    )
    max_video_decoded_pixels: int = opt(
        9000 * 1920 * 1080,
        "Most pixels the decoder may produce for one video, up to the last sampled frame "
        "(413 beyond; 5 minutes of 1080p at 30 fps). Checked on the header before decoding, "
        "so a tiny file declaring hours of 8K frames is refused without decoding.",
    )
    max_video_sampled_frames: int = opt(
        768, "Most frames sampled from one video (a request's max_frames may not exceed it).",
    )

    def __post_init__(self) -> None:
        _positive(self, "max_video_bytes", "max_video_seconds", "max_video_frame_pixels",
                  "max_video_decoded_frames", "max_video_decoded_pixels", "max_video_sampled_frames")
