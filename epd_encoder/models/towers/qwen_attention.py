# SPDX-License-Identifier: Apache-2.0
"""Packed variable-length attention and 2-D rotary positions for the Qwen vision towers.

Every forward attends over a list of segments (frames or windows) of a token stream that
holds many images. ``plan_segments`` groups the segments by length and ``varlen_attention``
runs each group as one batched ``scaled_dot_product_attention`` call, so the kernel
launches per layer are the distinct segment lengths, not the segments, and no token is
padded. ``Scratch`` holds the per-forward buffers a block reuses across layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class Scratch:
    """Activation buffers that every block of one forward reuses, by name.

    On CPU, large freed blocks go back to the OS, so a fresh activation per layer
    pays page faults on its first write (as long as the GEMM filling it, at 256 wide).
    A name's previous contents must be dead when it is taken again; a smaller shape
    takes the front of the name's buffer.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = self._bufs[name] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)


# ----------------------------------------------------------------------------- varlen
@dataclass(frozen=True)
class SegmentGroup:
    """``n`` segments of length ``length``: a contiguous run at ``start`` or gathered by ``index``."""

    n: int
    length: int
    start: int = 0
    index: torch.Tensor | None = None


@dataclass(frozen=True)
class VarlenPlan:
    total: int
    groups: tuple[SegmentGroup, ...]
    scratch: Scratch | None = field(default=None, compare=False)


def plan_segments(lengths: Sequence[int], device: torch.device) -> VarlenPlan:
    """Plan for segments laid end to end in ``lengths`` order."""
    by_len: dict[int, list[int]] = {}
    pos = 0
    for n in lengths:
        if n:
            by_len.setdefault(n, []).append(pos)
        pos += n
    groups = []
    for length, starts in by_len.items():
        first = starts[0]
        if starts[-1] - first == (len(starts) - 1) * length:
            groups.append(SegmentGroup(len(starts), length, start=first))
        else:
            st = torch.tensor(starts, device=device)
            idx = (st[:, None] + torch.arange(length, device=device)).reshape(-1)
            groups.append(SegmentGroup(len(starts), length, index=idx))
    return VarlenPlan(pos, tuple(groups))


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan, scale: float
) -> torch.Tensor:
    """Attention of ``[N, H, d]`` tensors within each planned segment; returns ``[N, H*d]``."""
    n_tok, heads, d = q.shape
    single = len(plan.groups) == 1 and plan.groups[0].index is None and plan.total == n_tok
    out: torch.Tensor | None
    if single:
        out = None
    elif plan.scratch is None:
        out = q.new_empty(n_tok, heads, d)
    else:
        out = plan.scratch.take("attn", (n_tok, heads, d), q.dtype, q.device)
    for g in plan.groups:
        rows = g.n * g.length
        if g.index is None:
            qs, ks, vs = (t.narrow(0, g.start, rows) for t in (q, k, v))
        else:
            qs, ks, vs = (t.index_select(0, g.index) for t in (q, k, v))
        shape = (g.n, g.length, heads, d)
        o = F.scaled_dot_product_attention(
            qs.reshape(shape).transpose(1, 2),
            ks.reshape(shape).transpose(1, 2),
            vs.reshape(shape).transpose(1, 2),
            scale=scale,
        )
        o = o.transpose(1, 2)
        if out is None:
            return o.reshape(n_tok, heads * d)
        if g.index is None:
            out.narrow(0, g.start, rows).view(shape).copy_(o)
        else:
            out.index_copy_(0, g.index, o.reshape(rows, heads, d))
    assert out is not None  # one group returned above; several fill ``out``
    return out.view(n_tok, heads * d)


# ----------------------------------------------------------------------------- rotary
def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))


def merge_block_positions(t: int, h: int, w: int, merge: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch in the processor's merge-block order, repeated per frame."""
    rows = torch.arange(h, device=device).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    cols = torch.arange(w, device=device).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    return rows.reshape(-1).repeat(t), cols.reshape(-1).repeat(t)


def rope_table(grid: tuple[int, int, int], merge: int, inv_freq: torch.Tensor):
    """``(cos, sin)`` of shape ``[t*h*w, head_dim // 2]`` (fp32) for one grid.

    The reference's tables repeat this half twice; only the half is kept.
    """
    rows, cols = merge_block_positions(*grid, merge, inv_freq.device)
    ang = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scratch: Scratch | None = None
) -> torch.Tensor:
    """Rotate q and k of ``qkv [N, 3, H, d]`` in fp32 by half tables ``[N, d/2]``; returns
    ``[N, 2, H, d]`` in qkv's dtype.

    Rotate-half is ``x * cos + (-x2, x1) * sin``: one product over both halves, then one
    ``addcmul`` per half. q and k are upcast once (mixed-dtype ops would cast per op).
    """
    n, _, heads, d = qkv.shape
    half = d // 2
    x = qkv[:, :2].unflatten(-1, (2, half))
    if x.dtype != torch.float32:
        x = x.float() if scratch is None else scratch.take("rope_in", x.shape, torch.float32, x.device).copy_(x)
    c = cos[:, None, None, None, :]
    if scratch is None:
        out = torch.mul(x, c)
    else:
        out = torch.mul(x, c, out=scratch.take("rope", x.shape, torch.float32, x.device))
    s = sin[:, None, None, :]
    out[..., 0, :].addcmul_(x[..., 1, :], s, value=-1)
    out[..., 1, :].addcmul_(x[..., 0, :], s)
    out = out.view(n, 2, heads, d)
    if qkv.dtype == torch.float32:
        return out
    if scratch is None:
        return out.to(qkv.dtype)
    return scratch.take("qk", out.shape, qkv.dtype, out.device).copy_(out)
