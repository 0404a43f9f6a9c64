# SPDX-License-Identifier: Apache-2.0
"""Prefill assembly for Kimi K2.5 (``Kimi_K25ForConditionalGeneration``) fed by the encode tier.

transformers' Kimi forward takes precomputed image features through
``mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=(rows, ...))}``
and scatters them at the ``<|media_pad|>`` tokens; nothing else of an image reaches the
LM. Its DeepSeek-V3 LM uses plain 1-D rotary positions: an image's tokens advance the
position one by one like text, so the grid plays no part in positions (no mrope, no
rope deltas, no deepstack). ``prefill.hf`` dispatches here for ``kimi_k25``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from epd_encoder.errors import InvalidInput

MODEL_TYPES = frozenset({"kimi_k25"})


def _runs(row: torch.Tensor) -> list[int]:
    flag = row.to(torch.int8)
    edges = torch.diff(flag, prepend=flag.new_zeros(1), append=flag.new_zeros(1))
    return ((edges == -1).nonzero().flatten() - (edges == 1).nonzero().flatten()).tolist()


def _check(model: Any, input_ids, items: Sequence[Any], attention_mask):
    """``(ids [B, L], mask | None, image_mask [B, L], embeds)``; ``InvalidInput`` on any mismatch."""
    config = model.config
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if ids.dim() != 2:
        raise InvalidInput(f"input_ids must be [L] or [B, L], got shape {tuple(ids.shape)}")
    mask = None
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask, device=ids.device)
        mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
        if tuple(mask.shape) != tuple(ids.shape):
            raise InvalidInput(f"attention_mask shape {tuple(mask.shape)} != input_ids {tuple(ids.shape)}")
    image_mask = ids == int(config.image_token_id)
    if bool((ids == int(config.video_token_id)).any()):
        raise InvalidInput("the prompt has video placeholders; Kimi K2.5 assembles image items only")
    runs = [n for row in image_mask for n in _runs(row)]
    if len(runs) != len(items):
        raise InvalidInput(
            f"prompt has {len(runs)} image placeholder runs ({sum(runs)} tokens) but {len(items)} items; "
            "expand each placeholder with expand_image_placeholders"
        )
    kh, kw = (int(k) for k in config.vision_config.merge_kernel_size)
    hidden = int(config.text_config.hidden_size)
    embeds = []
    for i, (item, run) in enumerate(zip(items, runs)):
        emb, grid = item.embedding, tuple(int(g) for g in item.grid_thw)
        if emb is None:
            raise InvalidInput(f"item {i} has no embedding (a pull item not fetched yet?)")
        if getattr(item, "modality", "image") != "image":
            raise InvalidInput(f"item {i}: Kimi K2.5 assembles image items only")
        if len(grid) != 3:
            raise InvalidInput(f"item {i}: grid_thw must be (t, h, w), got {grid}")
        want = (grid[1] // kh) * (grid[2] // kw)  # frames are averaged into one set of tokens
        if emb.dim() != 2 or emb.shape[0] != want or emb.shape[1] != hidden:
            raise InvalidInput(f"item {i}: embedding shape {tuple(emb.shape)}, grid {grid} needs [{want}, {hidden}]")
        if run != want:
            raise InvalidInput(f"image {i}: prompt has {run} placeholder tokens, item has {want} tokens")
        if item.deepstack:
            raise InvalidInput(f"item {i}: {len(item.deepstack)} deepstack tensors, kimi_k25 needs 0")
        embeds.append(emb)
    return ids, mask, image_mask, embeds


def build_generate_kwargs(model: Any, input_ids, items: Sequence[Any], attention_mask=None) -> dict[str, Any]:
    """``input_ids``, ``attention_mask`` (when given) and ``mm_encoder_outputs``: transformers
    scatters the rows itself. A fresh dict per call (``generate`` consumes it)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    ids, mask, _, embeds = _check(model, input_ids, items, attention_mask)
    kw: dict[str, Any] = {"input_ids": ids}
    if embeds:
        kw["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=tuple(embeds))}
    if mask is not None:
        kw["attention_mask"] = mask
    return kw


def build_prefill_inputs(model: Any, input_ids, items: Sequence[Any], attention_mask=None):
    """``inputs_embeds`` with the image rows scattered in, and the positions transformers' forward
    uses when given none (``0..L-1`` per row); ``rope_deltas`` are zeros."""
    from epd_encoder.prefill.hf import PrefillInputs

    ids, mask, image_mask, embeds = _check(model, input_ids, items, attention_mask)
    with torch.no_grad():
        # transformers embeds placeholder ids as 0 before the scatter overwrites them.
        text = model.model.get_input_embeddings()(ids.masked_fill(image_mask, 0))
        inputs_embeds = text
        if embeds:
            rows = torch.cat(embeds).to(text.device, text.dtype)
            inputs_embeds = text.masked_scatter(image_mask.unsqueeze(-1).to(text.device), rows)
    batch, length = ids.shape
    positions = torch.arange(length, device=ids.device).expand(batch, -1)
    return PrefillInputs(
        input_ids=ids, inputs_embeds=inputs_embeds, position_ids=positions,
        rope_deltas=torch.zeros((batch, 1), dtype=torch.long, device=ids.device), attention_mask=mask,
    )
