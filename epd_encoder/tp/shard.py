# SPDX-License-Identifier: Apache-2.0
"""Weights-mode tensor parallelism: shard a vision tower over N ranks, and load only a shard.

Megatron-style, per block: attention q/k/v are column-parallel by heads (rank ``r``
holds heads ``[r*H/N, (r+1)*H/N)`` of each of q, k and v), the attention output
projection is row-parallel; the MLP's input layer(s) are column-parallel and its
output layer row-parallel. Each row-parallel layer ends in one ``all_reduce``. The
merger MLPs (Qwen's patch merger, Qwen3-VL's deepstack mergers, InternVL's and Kimi's
projectors) are split the same way: their first Linear column-, their second
row-parallel. The patch embedding, norms, position embeddings and rotary tables are
replicated (small, and needed whole by every rank).

The plan is a list of ``(regex over the tower's parameter names, kind)`` per family:

- ``qkv``: a fused ``[3*H*d, in]`` weight (and bias) laid out ``[3, H, d]``; the rank
  takes its heads' rows from each third. Kimi's ``wqkv`` has the same layout: its
  interleaved rotary pairs are rows ``2i, 2i+1`` *inside* a head, so slicing by heads
  keeps every pair whole and the rotation code is unchanged.
- ``col``: a block of output rows (weight and bias).
- ``row``: a block of input columns of the weight; the bias stays whole and is added
  once, after the all-reduce.

Heads must divide by N (``ConfigError`` at shard time, before any weight is read or
any forward runs). MLP and merger widths need not: they split into balanced blocks
(widths differ by at most one column), because real widths are often not divisible
by 8 (Qwen2.5-VL's 3420) and the all-reduced output has the full width either way.

``shard_tower`` slices an already built tower (real or on the meta device) in place.
``load_vision_shard`` builds the tower on meta, shards it, and reads from the
safetensors files only the rank's slices (``safe_open(...).get_slice(name)[a:b]``), so
no rank ever holds the whole tower.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from epd_encoder.errors import CheckpointError, ConfigError
from epd_encoder.models.registry import LoadedVisionModel, get_family, read_family, resolve_dtype
from epd_encoder.tp import layers

_B = r"blocks\.\d+\."
_QWEN_ATTN = ((_B + r"attn\.qkv\.(weight|bias)", "qkv"), (_B + r"attn\.proj\.weight", "row"))
_QWEN2_MERGER = ((r"merger\.mlp\.0\.(weight|bias)", "col"), (r"merger\.mlp\.2\.weight", "row"))
_IV = r"vision_tower\.encoder\.layer\.\d+\."
_KIMI = r"vision_tower\.encoder\.blocks\.\d+\."

RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_vl": (*_QWEN_ATTN, (_B + r"mlp\.fc1\.(weight|bias)", "col"), (_B + r"mlp\.fc2\.weight", "row"),
                 *_QWEN2_MERGER),
    "qwen2_5_vl": (*_QWEN_ATTN, (_B + r"mlp\.(gate|up)_proj\.(weight|bias)", "col"),
                   (_B + r"mlp\.down_proj\.weight", "row"), *_QWEN2_MERGER),
    "qwen3_vl": (*_QWEN_ATTN, (_B + r"mlp\.linear_fc1\.(weight|bias)", "col"), (_B + r"mlp\.linear_fc2\.weight", "row"),
                 (r"(merger|deepstack_merger_list\.\d+)\.linear_fc1\.(weight|bias)", "col"),
                 (r"(merger|deepstack_merger_list\.\d+)\.linear_fc2\.weight", "row")),
    "internvl": ((_IV + r"attention\.[qkv]_proj\.(weight|bias)", "col"), (_IV + r"attention\.[qk]_norm\.weight", "col"),
                 (_IV + r"attention\.projection_layer\.weight", "row"), (_IV + r"mlp\.fc1\.(weight|bias)", "col"),
                 (_IV + r"mlp\.fc2\.weight", "row"), (r"multi_modal_projector\.linear_1\.(weight|bias)", "col"),
                 (r"multi_modal_projector\.linear_2\.weight", "row")),
    "kimi_k25": ((_KIMI + r"wqkv\.(weight|bias)", "qkv"), (_KIMI + r"wo\.weight", "row"),
                 (_KIMI + r"mlp\.fc0\.(weight|bias)", "col"), (_KIMI + r"mlp\.fc1\.weight", "row"),
                 (r"mm_projector\.proj\.0\.(weight|bias)", "col"), (r"mm_projector\.proj\.2\.weight", "row")),
}
# The tower's transformer blocks (for the per-rank fraction of block weights).
_BLOCKS = {"qwen2_vl": _B, "qwen2_5_vl": _B, "qwen3_vl": _B, "internvl": _IV, "kimi_k25": _KIMI}


def bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s block ``[a, b)`` of ``n``: balanced, sizes differ by at most one."""
    return n * rank // world, n * (rank + 1) // world


def take(src: Any, shape: tuple[int, ...], kind: str | None, rank: int, world: int) -> torch.Tensor:
    """Rank's part of a tensor or a safetensors slice ``src`` (anything indexable by slices)."""
    if kind is None or world == 1:
        return src[:]
    if kind == "col":
        a, b = bounds(shape[0], rank, world)
        return src[a:b]
    if kind == "row":
        a, b = bounds(shape[1], rank, world)
        return src[:, a:b]
    if kind == "qkv":  # [3, H, d] rows: this rank's heads of q, of k and of v
        third = shape[0] // 3
        a, b = bounds(third, rank, world)
        return torch.cat([src[i * third + a:i * third + b] for i in range(3)])
    raise ValueError(f"unknown shard kind {kind!r}")


@dataclass(frozen=True)
class ShardPlan:
    """Which of a family's parameters are split, and how (``kind`` of a name, ``None`` = whole)."""

    family: str
    rank: int
    world: int
    rules: tuple[tuple[re.Pattern[str], str], ...]

    def kind(self, name: str) -> str | None:
        for pattern, kind in self.rules:
            if pattern.fullmatch(name):
                return kind
        return None


def family_key(family_name: str) -> str:
    """The rules' key: a family name (``qwen3_vl``) or any model_type it serves (``qwen3_5``)."""
    if family_name in RULES:
        return family_name
    return get_family(family_name).name


def plan_for(family_name: str, rank: int, world: int) -> ShardPlan:
    key = family_key(family_name)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"tensor parallel rank {rank} of world {world} is out of range")
    return ShardPlan(key, rank, world, tuple((re.compile(p), k) for p, k in RULES[key]))


# Module trees are walked through attributes the family modules define; ``Any`` since
# nn.Module.__getattr__ is typed ``Tensor | Module``.
def _heads(key: str, tower: Any) -> list[Any]:
    """The attention modules, which hold the head count (``num_heads`` in InternViT, else ``heads``)."""
    if key == "internvl":
        return [layer.attention for layer in tower.vision_tower.encoder.layer]
    if key == "kimi_k25":
        return list(tower.vision_tower.encoder.blocks)
    return [blk.attn for blk in tower.blocks]


def _head_count(key: str, module: Any) -> int:
    return int(module.num_heads if key == "internvl" else module.heads)


def check_shardable(family_name: str, tower: nn.Module, world: int) -> None:
    """``ConfigError`` unless every head count divides by ``world`` and every split width is >= ``world``."""
    plan = plan_for(family_name, 0, world)
    for module in _heads(plan.family, tower):
        heads = _head_count(plan.family, module)
        if heads % world:
            raise ConfigError(
                f"{plan.family}: {heads} attention heads are not divisible by tensor parallel size {world} "
                f"(weights mode splits heads evenly; use a size that divides {heads}, or --tp-mode data)"
            )
    for name, p in tower.named_parameters():
        kind = plan.kind(name)
        if kind is not None:
            width = p.shape[1] if kind == "row" else p.shape[0] // (3 if kind == "qkv" else 1)
            if width < world:
                raise ConfigError(f"{plan.family}: {name} has width {width}, fewer than tensor parallel size {world}")


def _module(tower: nn.Module, dotted: str) -> Any:
    return tower.get_submodule(dotted) if dotted else tower


def shard_tower(family_name: str, tower: nn.Module, rank: int, world: int, group: Any = None) -> ShardPlan:
    """Shard ``tower`` (built for the full config; real or on meta) in place for ``rank`` of ``world``.

    Checks divisibility first (``ConfigError``; nothing is changed then), slices every
    planned parameter, and re-types the modules whose forward differs (``tp.layers``).
    ``group`` is the process group of the all-reduces (``None``: the default group).
    ``world == 1`` leaves the tower as it is.
    """
    plan = plan_for(family_name, rank, world)
    if world == 1:
        return plan
    check_shardable(plan.family, tower, world)
    for name, p in list(tower.named_parameters()):
        kind = plan.kind(name)
        if kind is None:
            continue
        owner, _, leaf = name.rpartition(".")
        part = take(p.data, tuple(p.shape), kind, rank, world).contiguous()
        setattr(_module(tower, owner), leaf, nn.Parameter(part, requires_grad=False))
        if kind == "row":
            linear = _module(tower, owner)
            linear.__class__ = layers.RowParallelLinear
            linear.tp_group = group
            linear.in_features = part.shape[1]
        elif leaf == "weight" and isinstance(_module(tower, owner), nn.Linear):
            _module(tower, owner).out_features = part.shape[0]
    _retype(plan.family, tower, world, group)
    return plan


def _retype(key: str, tower: Any, world: int, group: Any) -> None:
    for module in _heads(key, tower):
        if key == "internvl":
            full = module.q_proj.in_features
            module.head_dim = full // module.num_heads
            module.num_heads //= world
            module.__class__ = layers.InternAttentionTP
            for norm in (module.q_norm, module.k_norm):
                if not isinstance(norm, nn.Identity):
                    norm.__class__ = layers.InternRMSNormTP
                    norm.tp_group, norm.full_dim = group, full
        else:
            module.heads //= world
    if key == "kimi_k25":
        for blk in tower.vision_tower.encoder.blocks:
            blk.__class__ = layers.KimiBlockTP
    elif key != "internvl":
        for blk in tower.blocks:
            blk.__class__ = layers.QwenBlockTP


@dataclass(frozen=True)
class ShardStats:
    """Parameter counts of a tower and of each rank's shard (``per_rank[r]``), blocks apart."""

    world: int
    total: int
    replicated: int
    per_rank: tuple[int, ...]
    block_total: int
    block_per_rank: tuple[int, ...]

    @property
    def fraction(self) -> float:
        """Rank 0's share of all tower parameters (replicated ones count on every rank)."""
        return self.per_rank[0] / self.total

    @property
    def block_fraction(self) -> float:
        return self.block_per_rank[0] / self.block_total


def shard_stats(family_name: str, tower: nn.Module, world: int) -> ShardStats:
    """What each rank would hold of ``tower`` (unsharded; meta is fine: only shapes are read)."""
    key = family_key(family_name)
    blocks = re.compile(_BLOCKS[key])
    total = replicated = block_total = 0
    per_rank, block_rank = [0] * world, [0] * world
    for name, p in tower.named_parameters():
        n = p.numel()
        in_block = blocks.match(name) is not None
        total += n
        block_total += n if in_block else 0
        for r in range(world):
            kind = plan_for(key, r, world).kind(name)
            part = n if kind is None else take(torch.empty(p.shape, device="meta"), tuple(p.shape), kind, r,
                                               world).numel()
            per_rank[r] += part
            block_rank[r] += part if in_block else 0
        if plan_for(key, 0, world).kind(name) is None:
            replicated += n
    return ShardStats(world, total, replicated, tuple(per_rank), block_total, tuple(block_rank))


def load_vision_shard(
    ckpt_dir: str | Path,
    rank: int,
    world: int,
    group: Any = None,
    *,
    dtype: Any = None,
    device: str | torch.device = "cpu",
    model_id: str | None = None,
    progress: bool = True,
):
    """Build the family's tower on meta, shard it, and read only this rank's slices of its weights.

    Returns ``(LoadedVisionModel, LoadReport)``: the report's ``bytes`` are the bytes this
    rank read (its slices of split tensors plus the replicated ones, before any cast).
    The model's ``weights_digest`` identifies the whole tower's weights: with a process
    group up, the ranks' shard digests are all-gathered and hashed together (the same
    on every rank); without one it is the rank's shard digest, prefixed ``tp{N}r{rank}``.
    """
    from epd_encoder.models.loading.loader import load_strict, load_vision_weights

    path = Path(ckpt_dir)
    device = torch.device(device)
    resolved = resolve_dtype(dtype, device)
    family, config = read_family(path)
    with torch.device("meta"):
        tower = family.build_tower(config)
    plan = shard_tower(family.name, tower, rank, world, group)  # ConfigError before any weight is read

    def read(target: str, sl: Any) -> torch.Tensor:
        return take(sl, tuple(sl.get_shape()), plan.kind(target), rank, world)

    state, report = load_vision_weights(path, family.weight_prefixes, dtype=resolved, device=device,
                                        progress=progress, take=read)
    load_strict(tower, state, assign=True)
    left = [n for n, t in [*tower.named_parameters(), *tower.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{family.name}: tensors not provided by {path}: {', '.join(left[:10])}")
    tower = tower.to(device=device, dtype=resolved).eval()
    digest = _whole_digest(report.digest, rank, world, group, device)
    model = LoadedVisionModel(family, config, tower, model_id or path.resolve().name, resolved, device, digest)
    return model, report


def _whole_digest(shard_digest: str, rank: int, world: int, group: Any, device: torch.device) -> str:
    """One identity for the whole tower: every rank's shard digest, hashed in rank order."""
    import torch.distributed as dist
    from blake3 import blake3

    if world == 1:
        return shard_digest
    if not dist.is_initialized():
        return f"tp{world}r{rank}:{shard_digest}"
    mine = torch.tensor(list(bytes.fromhex(shard_digest)), dtype=torch.uint8, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    h = blake3(f"tp-weights|{world}|".encode())
    for p in parts:
        h.update(bytes(p.cpu().tolist()))
    return h.hexdigest()
