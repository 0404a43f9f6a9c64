# SPDX-License-Identifier: Apache-2.0
"""LLM-engine integrations (docs/integrations.md). Importing this package imports no engine:
each engine-facing module (a vLLM connector, the SGLang encoder protocol, the proxy) is imported
by its own path, inside the environment that has the engine."""

from epd_encoder.integrations.handoff import sglang_image_data, split_embeds, stack_items, vllm_multi_modal_data

__all__ = ["sglang_image_data", "split_embeds", "stack_items", "vllm_multi_modal_data"]
