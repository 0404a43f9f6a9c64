# SPDX-License-Identifier: Apache-2.0
"""Kimi K2.5 (``kimi_k25``): the MoonViT vision tower and its patch-merger projector, packed.

Math of transformers 5.24's ``Kimi_K25VisionModel`` + ``Kimi_K25MultimodalProjection``:
patch conv, a learned position grid bicubically resampled to each image (plus a
sinusoidal frame term for multi-frame clips), pre-norm blocks with 2-D rotary
attention over the whole item (all its frames), a final LayerNorm, a 2x2 merge
(frames averaged), then LayerNorm -> Linear -> GELU -> Linear.

Module names are the checkpoint's (the original MoonViT layout, which is also what
``save_pretrained`` writes: transformers renames and unfuses on load, and reverts it on
save). So the fused ``wqkv`` is kept, and its q/k rows are in the original interleaved
rotary order: rotary pair ``i`` is rows ``(2i, 2i+1)`` of a head. transformers permutes
those rows on load to rotate-half order; the attention scores are the same either way.

Pixels arrive as the processor emits them: ``[patches, 3, P, P]`` in raster order per
frame. The packed forward attends within each item (one segment of ``t*h*w`` tokens) with
the Qwen towers' length-grouped SDPA (``qwen_attention.varlen_attention``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.models.base import VisionFamily
from epd_encoder.models.towers.qwen_attention import plan_segments, varlen_attention
from epd_encoder.models.towers.qwen_vision import GridCache, activation, add_linear_
from epd_encoder.types import PreprocessedImage

Grid = tuple[int, int, int]


def _rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    spatial = head_dim // 2  # h and w each rotate a quarter of the head's dims
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))


def rope_angles(h: int, w: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[h*w, head_dim/2]`` in raster order: pair ``2f`` turns by ``col*inv[f]``,
    pair ``2f+1`` by ``row*inv[f]`` (transformers' flipped, interleaved (w, h) table)."""
    rows = torch.arange(h, device=inv_freq.device).repeat_interleave(w).float()
    cols = torch.arange(w, device=inv_freq.device).repeat(h).float()
    ang = torch.stack([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1).flatten(1)
    return ang.cos(), ang.sin()


def apply_rope_pairs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs of q and k of ``qkv [N, 3, H, d]`` in fp32; ``[N, 2, H, d]``."""
    qk = qkv[:, :2].float().unflatten(-1, (-1, 2))
    x, y = qk[..., 0], qk[..., 1]
    c, s = cos[:, None, None], sin[:, None, None]
    return torch.stack([x * c - y * s, y * c + x * s], dim=-1).flatten(-2).to(qkv.dtype)


def frame_table(dim: int, frames: int) -> torch.Tensor:
    """transformers' additive sinusoid per frame, row 0 the zero pad used by single frames."""
    pos = torch.arange(frames, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(pos, inv)
    return torch.cat([freqs.new_zeros(1, dim), torch.cat([freqs.sin(), freqs.cos()], dim=1)])


class _PosEmb(nn.Module):
    def __init__(self, h: int, w: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(h, w, dim))


class _PatchEmbed(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.patch = int(vc.patch_size)
        self.proj = nn.Conv2d(3, vc.hidden_size, kernel_size=self.patch, stride=self.patch)
        self.pos_emb = _PosEmb(vc.pos_emb_height, vc.pos_emb_width, vc.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # A conv whose kernel equals its stride, on one patch, is a GEMM of the flat patch.
        w = self.proj.weight
        return F.linear(pixels.reshape(pixels.shape[0], -1).to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden)
        self.fc1 = nn.Linear(hidden, dim)
        self.act = activation(act)


class _Block(nn.Module):
    """Pre-norm block; updates the residual stream in place (inference only)."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        dim, self.heads = vc.hidden_size, vc.num_attention_heads
        if dim % self.heads or (dim // self.heads) % 4:
            raise ConfigError(f"kimi_k25: hidden {dim} / {self.heads} heads must give a head_dim divisible by 4")
        self.head_dim = dim // self.heads
        self.scale = self.head_dim**-0.5
        self.norm0 = nn.LayerNorm(dim, eps=1e-5)
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.wo = nn.Linear(dim, dim)
        self.mlp = _Mlp(dim, vc.intermediate_size, vc.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan) -> torch.Tensor:
        qkv = self.wqkv(self.norm0(x)).view(x.shape[0], 3, self.heads, self.head_dim)
        qk = apply_rope_pairs(qkv, cos, sin)
        x = add_linear_(x, varlen_attention(qk[:, 0], qk[:, 1], qkv[:, 2], plan, self.scale), self.wo)
        return add_linear_(x, self.mlp.act(self.mlp.fc0(self.norm1(x))), self.mlp.fc1)


class _Encoder(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(vc) for _ in range(vc.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(vc.hidden_size, eps=1e-5)


class _VisionTower(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.patch_embed = _PatchEmbed(vc)
        self.encoder = _Encoder(vc)


class _Projector(nn.Module):
    def __init__(self, config: Any, merged: int) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(config.projection_hidden_size, eps=config.projection_layer_norm_eps)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, config.text_config.hidden_size))


class KimiK25Tower(nn.Module):
    """MoonViT + projector for packed batches; ``forward_packed`` returns ``[sum tokens, text_hidden]``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        self.kh, self.kw = (int(k) for k in vc.merge_kernel_size)
        self.side = int(vc.pos_emb_height)  # transformers resamples from a square grid of this side
        if int(vc.pos_emb_width) != self.side:
            raise ConfigError(f"kimi_k25: the position grid must be square, got {vc.pos_emb_height}x{vc.pos_emb_width}")
        self.frames = int(vc.pos_emb_time)
        self.dim = int(vc.hidden_size)
        rope = getattr(vc, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"kimi_k25: only axial vision rope is supported, got {rope.get('rope_type')!r}")
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.head_dim = self.dim // int(vc.num_attention_heads)
        self.vision_tower = _VisionTower(vc)
        self.mm_projector = _Projector(config, self.dim * self.kh * self.kw)
        self._cache = GridCache()

    # -- grid arithmetic ------------------------------------------------------------
    def tokens_for_grid(self, grid_thw: Sequence[int]) -> int:
        t, h, w = (int(v) for v in grid_thw)
        if h % self.kh or w % self.kw:
            raise ConfigError(f"kimi_k25: grid {h}x{w} is not divisible by the merge kernel {self.kh}x{self.kw}")
        return (h // self.kh) * (w // self.kw)  # frames are averaged into one

    def _check(self, grids: list[Grid], rows: int) -> None:
        for t, h, w in grids:
            if min(t, h, w) < 1 or h % self.kh or w % self.kw:
                raise EncodeFailed(f"kimi_k25: grid {(t, h, w)} is not a positive multiple of the merge kernel")
            if t > 1 and t > self.frames:
                raise EncodeFailed(f"kimi_k25: {t} frames exceed the {self.frames} frame embeddings")
        if rows != sum(math.prod(g) for g in grids):
            raise EncodeFailed(f"kimi_k25: pixel_values has {rows} patches but the grids need "
                               f"{sum(math.prod(g) for g in grids)}")

    # -- per-grid tables (cached: they depend on the grid and device only) --------------
    def _taps(self, h: int, w: int, device: torch.device):
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        idx, wts = get_vision_interpolation_indices_and_weights(
            torch.tensor([[1, h, w]]), self.side, mode="bicubic", align_corners=False)
        return idx.to(device), wts.to(device)

    def _rope(self, h: int, w: int, device: torch.device):
        return rope_angles(h, w, _rope_inv_freq(self.head_dim, self.rope_theta).to(device))

    def _merge_index(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        """Raster rows of each merged token's kh x kw block, row-major inside the block."""
        r = torch.arange(h, device=device).view(h // self.kh, 1, self.kh, 1)
        c = torch.arange(w, device=device).view(1, w // self.kw, 1, self.kw)
        return (r * w + c).reshape(-1)

    def _tables(self, grids: list[Grid], device: torch.device):
        def get(kind, g, build):
            return self._cache.get((kind, g[1], g[2], device), lambda: build(g[1], g[2], device))

        taps = [get("taps", g, self._taps) for g in grids for _ in range(g[0])]
        rope = [get("rope", g, self._rope) for g in grids for _ in range(g[0])]
        cat = (lambda xs: xs[0]) if len(taps) == 1 else torch.cat
        return (cat([i for i, _ in taps]), cat([w for _, w in taps]),
                cat([c for c, _ in rope]), cat([s for _, s in rope]))

    # -- forward ------------------------------------------------------------------------
    def forward_packed(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        grids = [(int(t), int(h), int(w)) for t, h, w in torch.as_tensor(grid_thw).reshape(-1, 3).tolist()]
        self._check(grids, pixel_values.shape[0])
        if not grids:
            return pixel_values.new_zeros((0, self.mm_projector.proj[2].out_features)), None
        device = pixel_values.device
        pe = self.vision_tower.patch_embed
        x = pe(pixel_values)
        idx, wts, cos, sin = self._tables(grids, device)
        table = pe.pos_emb.weight.flatten(0, 1)
        pos = F.embedding_bag(idx, table, per_sample_weights=wts.to(table.dtype), mode="sum")
        if any(t > 1 for t, _, _ in grids):
            pos = pos + self._frame_terms(grids, device, table.dtype)
        x = x + pos.to(x.dtype)
        plan = plan_segments([math.prod(g) for g in grids], device)
        enc = self.vision_tower.encoder
        for blk in enc.blocks:
            x = blk(x, cos, sin, plan)
        x = self.mm_projector.pre_norm(self._merge(enc.final_layernorm(x), grids))
        merged = x.view(-1, self.kh * self.kw * self.dim)
        return self.mm_projector.proj(merged), None

    def _frame_terms(self, grids: list[Grid], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        table = self._cache.get(("frames", device, dtype), lambda: frame_table(self.dim, self.frames).to(device, dtype))
        index = torch.cat([torch.arange(t, device=device).repeat_interleave(h * w) + int(t > 1) for t, h, w in grids])
        return table[index]

    def _merge(self, x: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """``[patches, D]`` -> ``[tokens * kh*kw, D]``: each merged token's block; frames averaged
        in fp32 in frame order (transformers' ``index_add_`` of ``x / t``)."""
        parts, start = [], 0
        for t, h, w in grids:
            n = h * w
            item = x.narrow(0, start, t * n)
            if t > 1:
                acc = torch.zeros((n, x.shape[1]), dtype=torch.float32, device=x.device)
                scale = torch.tensor(1.0 / t, dtype=torch.float32)
                for f in range(t):
                    acc += item[f * n:(f + 1) * n].float() * scale
                item = acc.to(x.dtype)
            order = self._cache.get(("merge", h, w, x.device), lambda: self._merge_index(h, w, x.device))
            parts.append(item.index_select(0, order))
            start += t * n
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def example_item(self) -> PreprocessedImage:
        """A small all-zero image (2x2 merged tokens), for warmup."""
        p = self.vision_tower.patch_embed.patch
        grid = (1, 2 * self.kh, 2 * self.kw)
        return PreprocessedImage(torch.zeros(grid[1] * grid[2], 3, p, p), grid, self.tokens_for_grid(grid))


def build_tower(config: Any) -> nn.Module:
    return KimiK25Tower(config)


def hf_reference(config: Any) -> nn.Module:
    from epd_encoder.models.kimi_k25_reference import KimiK25Reference

    return KimiK25Reference(config)


FAMILY = VisionFamily(
    name="kimi_k25",
    model_types=("kimi_k25",),
    # Checkpoint names (original MoonViT layout, also what save_pretrained writes). transformers
    # 5.24's save writes two with a stray prefix; the first matching pair wins, so they go first.
    weight_prefixes=(
        ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
        ("vision_tower.", "vision_tower."),
        ("model.mm_projector.", "mm_projector."),
        ("mm_projector.", "mm_projector."),
    ),
    build_tower=build_tower,
    hf_reference=hf_reference,
)
