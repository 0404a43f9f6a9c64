# SPDX-License-Identifier: Apache-2.0
"""transformers' own Kimi K2.5 image path behind our tower's state-dict names (tests, ``--tower reference``).

Our tower keeps the checkpoint layout (fused ``wqkv`` with interleaved rotary rows);
transformers' modules split it into ``q_proj/k_proj/v_proj`` and permute q/k rows to
rotate-half order when it loads a checkpoint. ``to_transformers`` / ``from_transformers``
are that conversion and its inverse, so ``KimiK25Reference.state_dict()`` has our names
and ``load_state_dict`` takes them: the loader's strict checks and the tests' weight
sharing work as for every other family.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

# ours (checkpoint layout) <-> transformers, for everything but wqkv
_PAIRS = [
    (r"vision_tower\.patch_embed\.pos_emb\.weight$", "vision_tower.patch_embed.pos_emb.position_embeddings"),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.norm0\.", r"vision_tower.layers.\1.norm1."),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.norm1\.", r"vision_tower.layers.\1.norm2."),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc0\.", r"vision_tower.layers.\1.mlp.fc1."),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc1\.", r"vision_tower.layers.\1.mlp.fc2."),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.wo\.", r"vision_tower.layers.\1.attn.proj."),
    (r"vision_tower\.encoder\.final_layernorm\.", "vision_tower.final_layernorm."),
    (r"mm_projector\.proj\.0\.", "mm_projector.in_proj."),
    (r"mm_projector\.proj\.2\.", "mm_projector.out_proj."),
]
_BACK = [  # the same pairs read the other way
    (r"vision_tower\.patch_embed\.pos_emb\.position_embeddings$", "vision_tower.patch_embed.pos_emb.weight"),
    (r"vision_tower\.layers\.(\d+)\.norm1\.", r"vision_tower.encoder.blocks.\1.norm0."),
    (r"vision_tower\.layers\.(\d+)\.norm2\.", r"vision_tower.encoder.blocks.\1.norm1."),
    (r"vision_tower\.layers\.(\d+)\.mlp\.fc1\.", r"vision_tower.encoder.blocks.\1.mlp.fc0."),
    (r"vision_tower\.layers\.(\d+)\.mlp\.fc2\.", r"vision_tower.encoder.blocks.\1.mlp.fc1."),
    (r"vision_tower\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.encoder.blocks.\1.wo."),
    (r"vision_tower\.final_layernorm\.", "vision_tower.encoder.final_layernorm."),
    (r"mm_projector\.in_proj\.", "mm_projector.proj.0."),
    (r"mm_projector\.out_proj\.", "mm_projector.proj.2."),
]
_WQKV = re.compile(r"vision_tower\.encoder\.blocks\.(\d+)\.wqkv\.(weight|bias)$")
_QKV = re.compile(r"vision_tower\.layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$")


def _rename(name: str, table) -> str:
    for pattern, repl in table:
        new, n = re.subn("^" + pattern, repl, name)
        if n:
            return new
    return name


def _permute(t: torch.Tensor, heads: int, inverse: bool) -> torch.Tensor:
    """transformers' ``PermuteForRope`` on q or k rows: per head, interleaved pairs -> halves."""
    half = t.shape[0] // heads // 2
    shape = (heads, 2, half) if inverse else (heads, half, 2)
    return t.reshape(*shape, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def to_transformers(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """Our names -> transformers' (``wqkv`` chunked, q/k rows permuted, as its loader does)."""
    out = {}
    for name, t in state.items():
        m = _WQKV.match(name)
        if m is None:
            out[_rename(name, _PAIRS)] = t
            continue
        q, k, v = t.chunk(3, dim=0)
        base = f"vision_tower.layers.{m.group(1)}.attn"
        out[f"{base}.q_proj.{m.group(2)}"] = _permute(q, heads, inverse=False)
        out[f"{base}.k_proj.{m.group(2)}"] = _permute(k, heads, inverse=False)
        out[f"{base}.v_proj.{m.group(2)}"] = v
    return out


def from_transformers(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """transformers' names -> ours: the inverse of ``to_transformers``."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        m = _QKV.match(name)
        if m is None:
            out[_rename(name, _BACK)] = t
            continue
        parts.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = (
            t if m.group(2) == "v" else _permute(t, heads, inverse=True))
    for (layer, kind), p in sorted(parts.items()):
        out[f"vision_tower.encoder.blocks.{layer}.wqkv.{kind}"] = torch.cat([p["q"], p["k"], p["v"]])
    return out


class KimiK25Reference(nn.Module):
    """``Kimi_K25Model.get_image_features`` (transformers' code, unchanged) on its own vision
    tower and projector; ``forward(pixel_values, grid_thw)`` returns an output whose
    ``pooler_output`` is the rows of all images, in order."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

        self.heads = int(config.vision_config.num_attention_heads)
        self.vision_tower = Kimi_K25VisionModel._from_config(config.vision_config)
        self.mm_projector = Kimi_K25MultimodalProjection(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25Model

        # get_image_features reads only self.vision_tower and self.mm_projector.
        out = Kimi_K25Model.get_image_features(self, pixel_values, grid_thw, return_dict=True)
        out.pooler_output = torch.cat(out.pooler_output)
        return out

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False):
        ours = from_transformers(super().state_dict(keep_vars=keep_vars), self.heads)
        if destination is None:
            return ours
        destination.update({prefix + k: v for k, v in ours.items()})
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return super().load_state_dict(to_transformers(dict(state_dict), self.heads), strict=strict, assign=assign)
