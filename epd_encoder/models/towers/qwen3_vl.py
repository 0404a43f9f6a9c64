# SPDX-License-Identifier: Apache-2.0
"""Qwen3-VL vision tower: learned position grid resampled per image, deepstack mergers.

An item's output is the main merged embedding plus one tensor per
``deepstack_visual_indexes`` layer, each with the same rows. Qwen3-VL-MoE has
the same vision part; Qwen3.5 (dense and MoE) has it without deepstack.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from epd_encoder.models.base import VisionFamily
from epd_encoder.models.towers.qwen2_vl import WEIGHT_PREFIXES, rope_theta
from epd_encoder.models.towers.qwen_attention import Scratch, merge_block_positions
from epd_encoder.models.towers.qwen_vision import (
    PatchEmbed,
    QwenTower,
    VisionAttention,
    VisionBlock,
    activation,
    activation_,
    linear,
)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = activation(act)
        self.act_ = activation_(act)

    @property
    def out(self) -> nn.Linear:
        return self.linear_fc2

    def hidden(self, x: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
        if scratch is None:
            return self.act(self.linear_fc1(x))
        return self.act_(linear(x, self.linear_fc1, scratch, "mlp"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.hidden(x))


class PatchMerger(nn.Module):
    """``postshuffle``: normalize the concatenated 2x2 block (deepstack) instead of each patch."""

    def __init__(self, dim: int, out_dim: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def bilinear_taps(grid: tuple[int, int, int], merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``[N, 4]`` into the ``side x side`` table and weights ``[N, 4]`` (align_corners).

    Rows follow the processor's merge-block order, repeated per frame.
    """
    t, h, w = grid
    rows, cols = merge_block_positions(t, h, w, merge, "cpu")

    def axis(i: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src = i.float() * (side - 1) / max(n - 1, 1)
        lo = src.floor()
        frac = src - lo
        lo = lo.long()
        return lo.clamp(0, side - 1), (lo + 1).clamp(0, side - 1), frac

    r0, r1, fr = axis(rows, h)
    c0, c1, fc = axis(cols, w)
    idx = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], dim=1)
    wts = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], dim=1)
    return idx, wts


class Qwen3VLTower(QwenTower):
    def __init__(self, vcfg: Any) -> None:
        super().__init__()
        dim, heads = vcfg.hidden_size, vcfg.num_heads
        merge = vcfg.spatial_merge_size
        self._init_common(merge, dim // heads, rope_theta(vcfg))
        self.patch_embed = PatchEmbed(vcfg.in_channels, vcfg.temporal_patch_size, vcfg.patch_size, dim, bias=True)
        self.pos_embed = nn.Embedding(vcfg.num_position_embeddings, dim)
        self.side = int(vcfg.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(
            VisionBlock(
                nn.LayerNorm(dim, eps=1e-6),
                nn.LayerNorm(dim, eps=1e-6),
                VisionAttention(dim, heads),
                Mlp(dim, vcfg.intermediate_size, vcfg.hidden_act),
            )
            for _ in range(vcfg.depth)
        )
        self.merger = PatchMerger(dim, vcfg.out_hidden_size, merge, postshuffle=False)
        self.deepstack_visual_indexes = [int(i) for i in getattr(vcfg, "deepstack_visual_indexes", None) or ()]
        self._deepstack_slot = {layer: j for j, layer in enumerate(self.deepstack_visual_indexes)}
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(dim, vcfg.out_hidden_size, merge, postshuffle=True) for _ in self.deepstack_visual_indexes
        )

    def add_positions(self, x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        device = x.device
        taps = [
            self.cached(("taps", g, device), lambda g=g: tuple(
                t.to(device) for t in bilinear_taps(g, self.merge, self.side)
            ))
            for g in grids
        ]
        idx = torch.cat([i for i, _ in taps]) if len(taps) > 1 else taps[0][0]
        wts = torch.cat([w for _, w in taps]) if len(taps) > 1 else taps[0][1]
        pos = F.embedding_bag(idx, self.pos_embed.weight.float(), per_sample_weights=wts, mode="sum")
        return x + pos.to(x.dtype)

    def after_block(self, i: int, x: torch.Tensor, deep: list[torch.Tensor]) -> None:
        j = self._deepstack_slot.get(i)
        if j is not None:
            deep.append(self.deepstack_merger_list[j](x))


def build_tower(config: Any) -> nn.Module:
    return Qwen3VLTower(config.vision_config)


_HF_MODULES = {
    "qwen3_vl": ("qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
    "qwen3_vl_moe": ("qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeVisionModel"),
    "qwen3_5": ("qwen3_5.modeling_qwen3_5", "Qwen3_5VisionModel"),
    "qwen3_5_moe": ("qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeVisionModel"),
}


def hf_reference(config: Any) -> nn.Module:
    import importlib

    module, name = _HF_MODULES[config.model_type]
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    return cls._from_config(config.vision_config)


FAMILY = VisionFamily(
    name="qwen3_vl",
    model_types=tuple(_HF_MODULES),
    weight_prefixes=WEIGHT_PREFIXES,
    build_tower=build_tower,
    hf_reference=hf_reference,
)
