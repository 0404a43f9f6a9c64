# SPDX-License-Identifier: Apache-2.0
"""Building blocks shared by the Qwen vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

The attention runs packed over variable-length segments with rotary positions
(``qwen_attention``); here are the blocks, the patch embedding, the layout cache and
the tower that stacks them.

Module attribute names follow the transformers modules so a checkpoint's
vision tensors, with their prefix stripped, load strictly.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.models.towers.qwen_attention import (
    Scratch,
    VarlenPlan,
    apply_rope,
    plan_segments,
    rope_inv_freq,
    rope_table,
    varlen_attention,
)
from epd_encoder.types import PreprocessedImage

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


# In place on their argument, bitwise equal to the functions above.
_ACTIVATIONS_INPLACE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x.mul_(torch.sigmoid_(1.702 * x)),
    "silu": lambda x: F.silu(x, inplace=True),
    "gelu": lambda x: torch.ops.aten.gelu_(x),
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "gelu_new": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError as e:
        raise ConfigError(f"unsupported vision activation {name!r}") from e


def activation_(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    activation(name)
    return _ACTIVATIONS_INPLACE[name]


def linear(x: torch.Tensor, lin: nn.Module, scratch: Scratch | None, name: str) -> torch.Tensor:
    """``lin(x)`` for 2-D ``x``, written into ``scratch`` when ``lin`` is a plain ``nn.Linear``
    (a subclass, such as a tensor-parallel layer, runs its own forward)."""
    if scratch is None or type(lin) is not nn.Linear:
        return lin(x)
    out = scratch.take(name, (x.shape[0], lin.weight.shape[0]), x.dtype, x.device)
    if lin.bias is None:
        return torch.mm(x, lin.weight.t(), out=out)
    return torch.addmm(lin.bias, x, lin.weight.t(), out=out)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 and scale in the input dtype, as the reference does.
        if x.is_cuda:  # fused kernel, fp32 accumulation
            return F.rms_norm(x, (x.shape[-1],), eps=self.eps).mul_(self.weight)
        xf = x.float()
        inv = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1])
        inv = inv.add_(self.eps).rsqrt_()
        return (xf * inv).to(x.dtype).mul_(self.weight)


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride is a linear map of the flat patch."""

    def __init__(self, in_channels: int, temporal: int, patch: int, dim: int, bias: bool) -> None:
        super().__init__()
        k = (temporal, patch, patch)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=k, stride=k, bias=bias)
        self.dim = dim

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.view(self.dim, -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        """Attention output before ``proj``: ``[N, dim]``."""
        qkv = linear(x, self.qkv, plan.scratch, "qkv").view(x.shape[0], 3, self.heads, self.head_dim)
        qk = apply_rope(qkv, cos, sin, plan.scratch)
        return varlen_attention(qk[:, 0], qk[:, 1], qkv[:, 2], plan, self.scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        return self.proj(self.mix(x, cos, sin, plan))


def add_linear_(x: torch.Tensor, h: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``x += linear(h)`` in place: the GEMM accumulates into the residual stream."""
    x.addmm_(h, linear.weight.t())
    if linear.bias is not None:
        x.add_(linear.bias)
    return x


class VisionBlock(nn.Module):
    """Pre-norm block. ``mlp`` exposes ``hidden(x, scratch=None)`` and its output projection ``out``.

    The block updates its input in place: the tower owns the residual stream.
    """

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm1
        self.norm2 = norm2
        self.attn = attn
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        x = add_linear_(x, self.attn.mix(self.norm1(x), cos, sin, plan), self.attn.proj)
        rows = max(x.shape[0], 1) if plan.scratch is None else mlp_rows(self.mlp.out.in_features, x.element_size())
        for start in range(0, x.shape[0], rows):
            xs = x[start:start + rows]
            add_linear_(xs, self.mlp.hidden(self.norm2(xs), plan.scratch), self.mlp.out)
        return x


def mlp_rows(hidden: int, element_size: int) -> int:
    """Rows per MLP step with scratch (fp32 on CPU): as many as keep one ``[rows, hidden]``
    activation within about 1 MB, so the bias, activation and gating passes run in cache
    (the MLP is row-wise)."""
    return max(64, (1 << 20) // (hidden * element_size))


class GridCache:
    """A small LRU for per-grid tables (they depend only on the grid and the device)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._data: OrderedDict[Hashable, object] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], object]):
        hit = self._data.get(key)
        if hit is not None:
            self._data.move_to_end(key)
            return hit
        value = build()
        self._data[key] = value
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._data)


@dataclass(frozen=True)
class Layout:
    """How one packed batch runs through the blocks.

    Tokens are in the processor's (natural) order unless ``windowed[i]``: then
    block ``i`` runs with merge units reordered by ``unit_perm`` (natural ->
    windowed: ``x_w = x_n[unit_perm]``, back with ``unit_inverse``). Each
    block has its attention plan and the rotary tables of its order.
    """

    plans: tuple[VarlenPlan, ...]
    rope: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    windowed: tuple[bool, ...]
    unit_perm: torch.Tensor | None = None
    unit_inverse: torch.Tensor | None = None


def with_scratch(lay: Layout, scratch: Scratch) -> Layout:
    plans = {id(p): replace(p, scratch=scratch) for p in lay.plans}
    return replace(lay, plans=tuple(plans[id(p)] for p in lay.plans))


class QwenTower(nn.Module):
    """The packed forward shared by the Qwen towers; families supply the layout and hooks.

    Inference only: blocks update the residual stream in place (no autograd).
    """

    merge: int
    head_dim: int
    rope_theta: float

    def _init_common(self, merge: int, head_dim: int, rope_theta: float) -> None:
        self.merge = merge
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self._grid_cache = GridCache()

    def tokens_for_grid(self, grid_thw: Sequence[int]) -> int:
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // (self.merge * self.merge)

    def forward_packed(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        grids = grids_of(grid_thw)
        check_grids(grids, self.merge, pixel_values.shape[0])
        x = self.patch_embed(pixel_values)
        x = self.add_positions(x, grids)
        lay = self.layout(grids, x.device)
        # fp32 on CPU only: CUDA's caching allocator already reuses blocks, and a bf16 oneDNN
        # GEMM with ``out=`` adds its bias in a pass of its own (measured 10% slower overall).
        if x.device.type == "cpu" and x.dtype == torch.float32:
            lay = with_scratch(lay, Scratch())
        unit = self.merge * self.merge
        windowed = False
        deep: list[torch.Tensor] = []
        for i, blk in enumerate(self.blocks):
            if lay.windowed[i] != windowed:
                windowed = lay.windowed[i]
                order = lay.unit_perm if windowed else lay.unit_inverse
                x = x.view(-1, unit, x.shape[-1]).index_select(0, order).view(x.shape)
            cos, sin = lay.rope[i]
            x = blk(x, cos, sin, lay.plans[i])
            n_deep = len(deep)
            self.after_block(i, x, deep)
            if windowed and len(deep) > n_deep:
                deep[-1] = deep[-1].index_select(0, lay.unit_inverse)
        out = self.merger(x)
        if windowed:
            out = out.index_select(0, lay.unit_inverse)
        return out, (deep or None)

    def example_item(self) -> PreprocessedImage:
        """A small all-zero input (one frame of 2x2 merge blocks), for warmup."""
        p = self.patch_embed.proj
        grid = (1, 2 * self.merge, 2 * self.merge)
        pixels = torch.zeros(grid[1] * grid[2], p.weight[0].numel())
        return PreprocessedImage(pixels, grid, self.tokens_for_grid(grid))

    def add_positions(self, x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return x

    def after_block(self, i: int, x: torch.Tensor, deep: list[torch.Tensor]) -> None:
        return None

    def layout(self, grids: list[tuple[int, int, int]], device: torch.device) -> Layout:
        cos, sin = self.rope_for(grids, device)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        n = len(self.blocks)
        return Layout((plan_segments(frames, device),) * n, ((cos, sin),) * n, (False,) * n)

    def rope_for(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        tables = [self.cached(("rope", g, device), lambda g=g: self._rope(g, device)) for g in grids]
        if len(tables) == 1:
            return tables[0]
        return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])

    def cached(self, key: Hashable, build: Callable[[], object]):
        return self._grid_cache.get(key, build)

    def _rope(self, grid, device):
        inv = rope_inv_freq(self.head_dim, self.rope_theta).to(device)
        return rope_table(grid, self.merge, inv)


def grids_of(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def check_grids(grids: Sequence[tuple[int, int, int]], merge: int, rows: int) -> None:
    for g in grids:
        if g[0] < 1 or g[1] % merge or g[2] % merge or min(g) < 1:
            raise EncodeFailed(f"grid {g} is not a positive multiple of the merge size {merge}")
    expect = sum(math.prod(g) for g in grids)
    if rows != expect:
        raise EncodeFailed(f"pixel_values has {rows} rows but the grids need {expect}")
