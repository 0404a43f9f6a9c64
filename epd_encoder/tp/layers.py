# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel forwards of the towers' modules (weights mode).

``shard.py`` slices a tower's parameters in place and re-types the modules that
need another forward to one of these subclasses (``module.__class__ = ...``):
attribute and parameter names stay the ones of the unsharded tower, so the
checkpoint names, ``load_strict`` and ``state_dict`` keep working unchanged.

Column-parallel layers need no new forward: an ``nn.Linear`` holding a block of
output rows just produces that block. What changes:

- ``RowParallelLinear``: each rank holds a block of input columns; the partial
  products are summed with one ``all_reduce``, then the (replicated) bias is added
  once. This is the only collective of the forward (plus qk-norm's below).
- blocks whose residual update fuses the output GEMM into the stream
  (``add_linear_``: ``x.addmm_``) add the all-reduced output instead: a rank-local
  ``addmm_`` into the residual would be summed N times.
- attention views its qkv with the rank's head count (set by ``shard.py``).
- InternVL's qk-norm normalizes over the whole hidden (all heads): the sum of
  squares is all-reduced, so each rank normalizes its heads by the full-width RMS.

Inference only: residual streams are updated in place, as in the unsharded towers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from epd_encoder.models.towers.internvl import _Attention as InternAttention
from epd_encoder.models.towers.internvl import _RMSNorm as InternRMSNorm
from epd_encoder.models.towers.kimi_k25 import _Block as KimiBlock
from epd_encoder.models.towers.kimi_k25 import apply_rope_pairs
from epd_encoder.models.towers.qwen_attention import varlen_attention
from epd_encoder.models.towers.qwen_vision import VisionBlock


def all_reduce_(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``t`` over the group in place (the group's ranks all call this, in the same order)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class RowParallelLinear(torch.nn.Linear):
    """``weight`` holds this rank's input columns; ``bias`` is whole and added once, after the sum."""

    tp_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce_(F.linear(x, self.weight), self.tp_group)
        return y if self.bias is None else y.add_(self.bias)


class QwenBlockTP(VisionBlock):
    """Qwen block: ``attn.qkv`` and the MLP's input layers column-parallel, ``attn.proj`` and
    ``mlp.out`` row-parallel (``RowParallelLinear``); ``attn.heads`` is the rank's head count."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan) -> torch.Tensor:
        attn: Any = self.attn
        mlp: Any = self.mlp
        x = x.add_(attn.proj(attn.mix(self.norm1(x), cos, sin, plan)))
        return x.add_(mlp.out(mlp.hidden(self.norm2(x))))


class KimiBlockTP(KimiBlock):
    """MoonViT block: ``wqkv`` sliced by heads (rotary pairs stay inside a head), ``wo`` and
    ``mlp.fc1`` row-parallel; ``heads`` is the rank's head count."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan) -> torch.Tensor:
        qkv = self.wqkv(self.norm0(x)).view(x.shape[0], 3, self.heads, self.head_dim)
        qk = apply_rope_pairs(qkv, cos, sin)
        x = x.add_(self.wo(varlen_attention(qk[:, 0], qk[:, 1], qkv[:, 2], plan, self.scale)))
        return x.add_(self.mlp.fc1(self.mlp.act(self.mlp.fc0(self.norm1(x)))))


class InternAttentionTP(InternAttention):
    """InternViT attention over the rank's heads: ``num_heads`` local, ``head_dim`` set by shard.py
    (the unsharded forward derives it from the full width, which a rank no longer has)."""

    head_dim: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        shape = (b, n, self.num_heads, self.head_dim)
        q = self.q_norm(self.q_proj(x)).view(shape).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.projection_layer(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class InternRMSNormTP(InternRMSNorm):
    """qk-norm over the full hidden when each rank holds ``1/N`` of it: the sum of squares is
    all-reduced, then divided by the full width ``full_dim``."""

    tp_group: Any = None
    full_dim: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        ss = all_reduce_(h.pow(2).sum(-1, keepdim=True), self.tp_group)
        h = h * torch.rsqrt(ss / self.full_dim + self.eps)
        return self.weight * h.to(x.dtype)
