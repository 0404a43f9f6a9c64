# SPDX-License-Identifier: Apache-2.0
"""The prefill side: run a language model on embeddings from the encode tier (docs/prefill.md)."""

from epd_encoder.prefill.hf import (
    PrefillInputs,
    VisionItem,
    build_generate_kwargs,
    build_prefill_inputs,
    expand_image_placeholders,
    greedy_generate,
    prefill_forward,
)
from epd_encoder.prefill.items import PrefillItem, as_video
from epd_encoder.prefill.video import expand_vision_placeholders, frame_timestamps, timestamp_text

__all__ = [
    "PrefillInputs",
    "PrefillItem",
    "VisionItem",
    "as_video",
    "build_generate_kwargs",
    "build_prefill_inputs",
    "expand_image_placeholders",
    "expand_vision_placeholders",
    "frame_timestamps",
    "greedy_generate",
    "prefill_forward",
    "timestamp_text",
]
