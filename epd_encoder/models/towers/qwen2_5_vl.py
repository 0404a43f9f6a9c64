# SPDX-License-Identifier: Apache-2.0
"""Qwen2.5-VL vision tower: RMSNorm, gated MLP, window attention with full-attention layers.

Window layout: the merge units of the whole batch are reordered once so that
windows of equal length sit next to each other (full windows of every image
first), so window layers attend over contiguous runs with no gather. The few
full-attention layers run in the processor's order, where each frame is
contiguous; the residual stream is permuted only when the order changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epd_encoder.models.base import VisionFamily
from epd_encoder.models.towers.qwen2_vl import WEIGHT_PREFIXES, PatchMerger, rope_theta
from epd_encoder.models.towers.qwen_attention import Scratch, plan_segments
from epd_encoder.models.towers.qwen_vision import (
    Layout,
    PatchEmbed,
    QwenTower,
    RMSNorm,
    VisionAttention,
    VisionBlock,
    activation,
    activation_,
    linear,
)


class GatedMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act = activation(act)
        self.act_ = activation_(act)

    @property
    def out(self) -> nn.Linear:
        return self.down_proj

    def hidden(self, x: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
        if scratch is None:
            return self.act(self.gate_proj(x)).mul_(self.up_proj(x))
        gate = self.act_(linear(x, self.gate_proj, scratch, "mlp"))
        return gate.mul_(linear(x, self.up_proj, scratch, "mlp_up"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


def grid_windows(grid: tuple[int, int, int], merge: int, win: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge units of one grid in window order and the window lengths (in units).

    Windows tile each frame's merged grid row-major, ``win`` units a side (the
    last row/column may be short); units inside a window stay row-major.
    """
    t, h, w = grid
    gh, gw = h // merge, w // merge
    nwh, nww = -(-gh // win), -(-gw // win)
    r = torch.arange(gh).view(gh, 1) // win
    c = torch.arange(gw).view(1, gw) // win
    wid = (r * nww + c).reshape(1, -1) + torch.arange(t).view(t, 1) * (nwh * nww)
    wid = wid.reshape(-1)
    units = torch.sort(wid, stable=True).indices
    lengths = torch.bincount(wid, minlength=t * nwh * nww)
    return units, lengths


class Qwen2_5_VLTower(QwenTower):
    def __init__(self, vcfg: Any) -> None:
        super().__init__()
        dim, heads = vcfg.hidden_size, vcfg.num_heads
        merge = vcfg.spatial_merge_size
        self._init_common(merge, dim // heads, rope_theta(vcfg))
        self.window_units = vcfg.window_size // merge // vcfg.patch_size
        self.fullatt = frozenset(int(i) for i in vcfg.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(vcfg.in_channels, vcfg.temporal_patch_size, vcfg.patch_size, dim, bias=False)
        self.blocks = nn.ModuleList(
            VisionBlock(
                RMSNorm(dim),
                RMSNorm(dim),
                VisionAttention(dim, heads),
                GatedMlp(dim, vcfg.intermediate_size, vcfg.hidden_act),
            )
            for _ in range(vcfg.depth)
        )
        self.merger = PatchMerger(vcfg.out_hidden_size, dim, merge, rms=True)

    def layout(self, grids: list[tuple[int, int, int]], device: torch.device) -> Layout:
        unit = self.merge * self.merge
        units, lengths, offset = [], [], 0
        for g in grids:
            u, n = self.cached(("windows", g), lambda g=g: grid_windows(g, self.merge, self.window_units))
            units.append(u + offset)
            lengths.append(n)
            offset += g[0] * g[1] * g[2] // unit
        units_cat, win_len = torch.cat(units), torch.cat(lengths)
        # Stable sort of windows by length (longest first), then of units by window rank.
        order = torch.sort(-win_len, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        win_of_unit = torch.repeat_interleave(torch.arange(win_len.numel()), win_len)
        perm = units_cat[torch.sort(rank[win_of_unit], stable=True).indices]
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        window_plan = plan_segments((win_len[order] * unit).tolist(), device)

        frames = [h * w for t, h, w in grids for _ in range(t)]
        full_plan = plan_segments(frames, device)
        cos, sin = self.rope_for(grids, device)
        perm, inverse = perm.to(device), inverse.to(device)
        hd = cos.shape[-1]
        win_rope = tuple(t.view(-1, unit, hd).index_select(0, perm).view(-1, hd) for t in (cos, sin))
        n = len(self.blocks)
        return Layout(
            plans=tuple(full_plan if i in self.fullatt else window_plan for i in range(n)),
            rope=tuple((cos, sin) if i in self.fullatt else win_rope for i in range(n)),
            windowed=tuple(i not in self.fullatt for i in range(n)),
            unit_perm=perm,
            unit_inverse=inverse,
        )


def build_tower(config: Any) -> nn.Module:
    return Qwen2_5_VLTower(config.vision_config)


def hf_reference(config: Any) -> nn.Module:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)


FAMILY = VisionFamily(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    weight_prefixes=WEIGHT_PREFIXES,
    build_tower=build_tower,
    hf_reference=hf_reference,
)
