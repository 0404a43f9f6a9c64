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

__all__ = [
    "PrefillInputs",
    "VisionItem",
    "build_generate_kwargs",
    "build_prefill_inputs",
    "expand_image_placeholders",
    "greedy_generate",
    "prefill_forward",
]
