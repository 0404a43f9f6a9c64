# SPDX-License-Identifier: Apache-2.0
"""Qwen2-VL vision tower: LayerNorm blocks, full attention per frame, 2x2 patch merger."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epd_encoder.models.base import VisionFamily
from epd_encoder.models.towers.qwen_attention import Scratch
from epd_encoder.models.towers.qwen_vision import (
    PatchEmbed,
    QwenTower,
    RMSNorm,
    VisionAttention,
    VisionBlock,
    activation,
    activation_,
    linear,
)

WEIGHT_PREFIXES = (("model.visual.", ""), ("visual.", ""))


def rope_theta(vcfg: Any) -> float:
    params = getattr(vcfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(vcfg, "rope_theta", 10000.0)))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)
        self.act_ = activation_(act)

    @property
    def out(self) -> nn.Linear:
        return self.fc2

    def hidden(self, x: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
        if scratch is None:
            return self.act(self.fc1(x))
        return self.act_(linear(x, self.fc1, scratch, "mlp"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.hidden(x))


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each 2x2 block, project to the LM width."""

    def __init__(self, out_dim: int, dim: int, merge: int, rms: bool = False) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = RMSNorm(dim) if rms else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VLTower(QwenTower):
    def __init__(self, vcfg: Any) -> None:
        super().__init__()
        dim, heads = vcfg.embed_dim, vcfg.num_heads
        self._init_common(vcfg.spatial_merge_size, dim // heads, rope_theta(vcfg))
        self.patch_embed = PatchEmbed(vcfg.in_channels, vcfg.temporal_patch_size, vcfg.patch_size, dim, bias=False)
        hidden = int(dim * vcfg.mlp_ratio)
        self.blocks = nn.ModuleList(
            VisionBlock(
                nn.LayerNorm(dim, eps=1e-6),
                nn.LayerNorm(dim, eps=1e-6),
                VisionAttention(dim, heads),
                Mlp(dim, hidden, vcfg.hidden_act),
            )
            for _ in range(vcfg.depth)
        )
        self.merger = PatchMerger(vcfg.hidden_size, dim, vcfg.spatial_merge_size)


def build_tower(config: Any) -> nn.Module:
    return Qwen2VLTower(config.vision_config)


def hf_reference(config: Any) -> nn.Module:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    return Qwen2VisionTransformerPretrainedModel._from_config(config.vision_config)


FAMILY = VisionFamily(
    name="qwen2_vl",
    model_types=("qwen2_vl",),
    weight_prefixes=WEIGHT_PREFIXES,
    build_tower=build_tower,
    hf_reference=hf_reference,
)
