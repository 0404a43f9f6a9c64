# SPDX-License-Identifier: Apache-2.0
"""InternVL (transformers' native ``internvl`` model_type): InternViT + pixel shuffle + MLP.

Module names mirror transformers' ``InternVLModel`` below ``vision_tower.`` and
``multi_modal_projector.``, so the checkpoint's vision tensors load strictly once
their prefix is mapped by ``FAMILY.weight_prefixes``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.models.base import VisionFamily


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else (int(v), int(v))


def _activation(name: str) -> nn.Module:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class _RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, then back to the input dtype before the weight (as transformers does)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(vc: Any) -> nn.Module:
    if vc.norm_type == "layer_norm":
        return nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
    if vc.norm_type == "rms_norm":
        return _RMSNorm(vc.hidden_size, eps=vc.layer_norm_eps)
    raise ConfigError(f"internvl: unsupported vision norm_type {vc.norm_type!r}")


class _PatchEmbeddings(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        patch = _pair(vc.patch_size)
        self.projection = nn.Conv2d(vc.num_channels, vc.hidden_size, kernel_size=patch, stride=patch)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.projection(pixel_values.to(self.projection.weight.dtype))
        return x.flatten(2).transpose(1, 2)


class _Embeddings(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        image, patch = _pair(vc.image_size), _pair(vc.patch_size)
        self.grid = (image[0] // patch[0], image[1] // patch[1])
        self.cls_token = nn.Parameter(torch.zeros(1, 1, vc.hidden_size))
        # never used at inference, present so the checkpoint loads strictly
        self.mask_token = nn.Parameter(torch.zeros(1, 1, vc.hidden_size)) if vc.use_mask_token else None
        self.patch_embeddings = _PatchEmbeddings(vc)
        n = self.grid[0] * self.grid[1] + 1
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, n, vc.hidden_size)) if vc.use_absolute_position_embeddings else None
        )

    def _positions(self, h: int, w: int) -> torch.Tensor:
        pos = self.position_embeddings
        if (h, w) == self.grid:
            return pos
        # bicubic resize of the patch grid; computed in fp32 so half dtypes work on every backend
        dim = pos.shape[-1]
        grid = pos[:, 1:].float().reshape(1, self.grid[0], self.grid[1], dim).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        grid = grid.permute(0, 2, 3, 1).reshape(1, h * w, dim).to(pos.dtype)
        return torch.cat((pos[:, :1], grid), dim=1)

    def forward(self, pixel_values: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = self.patch_embeddings(pixel_values)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        if self.position_embeddings is not None:
            x = x + self._positions(h, w)
        return x


class _Attention(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        d = vc.hidden_size
        if d % vc.num_attention_heads:
            raise ConfigError(f"internvl: hidden_size {d} not divisible by {vc.num_attention_heads} heads")
        self.num_heads = vc.num_attention_heads
        self.q_proj = nn.Linear(d, d, bias=vc.attention_bias)
        self.k_proj = nn.Linear(d, d, bias=vc.attention_bias)
        self.v_proj = nn.Linear(d, d, bias=vc.attention_bias)
        self.projection_layer = nn.Linear(d, d)
        # qk-norm spans the whole hidden (all heads together), with its own default eps
        self.q_norm = _RMSNorm(d) if vc.use_qk_norm else nn.Identity()
        self.k_norm = _RMSNorm(d) if vc.use_qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        shape = (b, n, self.num_heads, d // self.num_heads)
        q = self.q_norm(self.q_proj(x)).view(shape).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.projection_layer(out.transpose(1, 2).reshape(b, n, d))


class _MLP(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.act = _activation(vc.hidden_act)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.attention = _Attention(vc)
        self.mlp = _MLP(vc)
        self.layernorm_before = _norm(vc)
        self.layernorm_after = _norm(vc)
        self.lambda_1 = nn.Parameter(torch.full((vc.hidden_size,), float(vc.layer_scale_init_value)))
        self.lambda_2 = nn.Parameter(torch.full((vc.hidden_size,), float(vc.layer_scale_init_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class _Encoder(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(vc) for _ in range(vc.num_hidden_layers))


class _VisionModel(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.embeddings = _Embeddings(vc)
        self.encoder = _Encoder(vc)
        self.layernorm = (
            nn.Identity() if vc.use_mean_pooling else nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        )


class _Projector(nn.Module):
    def __init__(self, config: Any, merged_hidden: int) -> None:
        super().__init__()
        text_hidden = config.text_config.hidden_size
        self.layer_norm = nn.LayerNorm(merged_hidden)
        self.linear_1 = nn.Linear(merged_hidden, text_hidden)
        self.act = _activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def _merge_factor(downsample_ratio: float) -> int:
    k = round(1.0 / float(downsample_ratio))
    if k < 1 or abs(k * float(downsample_ratio) - 1.0) > 1e-6:
        raise ConfigError(f"internvl: downsample_ratio {downsample_ratio} is not 1/k for an integer k")
    return k


def _layers_to_run(feature_layer: Any, num_layers: int) -> tuple[int, bool]:
    """(encoder layers to run, whether the final norm applies) for ``vision_feature_layer``."""
    if isinstance(feature_layer, bool) or not isinstance(feature_layer, int):
        raise ConfigError(f"internvl: vision_feature_layer must be one int, got {feature_layer!r}")
    if feature_layer == -1:
        return num_layers, True
    # hidden_states[0] is the embedding output, hidden_states[i] the output of layer i
    if not -(num_layers + 1) <= feature_layer <= num_layers:
        raise ConfigError(f"internvl: vision_feature_layer {feature_layer} out of range")
    return feature_layer % (num_layers + 1), False


def pixel_shuffle(x: torch.Tensor, h: int, w: int, k: int) -> torch.Tensor:
    """``[B, h*w, C]`` -> ``[B, (h/k)*(w/k), k*k*C]``; each k×k block joins row-major."""
    b, _, c = x.shape
    x = x.reshape(b, h // k, k, w // k, k, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // k) * (w // k), k * k * c)


class InternVLVisionTower(nn.Module):
    """InternVL's image path, ``InternVLModel.get_image_features`` for packed tiles.

    Built from the full ``InternVLConfig``. All tiles of a batch share one size, so
    they run as one ``[tiles, 1 + h*w, hidden]`` batch; each tile attends only to
    itself, hence items never see each other.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        if config.vision_feature_select_strategy != "default":
            raise ConfigError(
                f"internvl: vision_feature_select_strategy {config.vision_feature_select_strategy!r} "
                "is unsupported (only 'default', which drops the CLS token)"
            )
        self.patch = _pair(vc.patch_size)
        self.merge = _merge_factor(config.downsample_ratio)
        self.num_run, self.final_norm = _layers_to_run(config.vision_feature_layer, vc.num_hidden_layers)
        self.out_hidden = int(config.text_config.hidden_size)
        self.vision_tower = _VisionModel(vc)
        self.multi_modal_projector = _Projector(config, vc.hidden_size * self.merge**2)

    def tokens_for_grid(self, grid_thw: Sequence[int]) -> int:
        t, h, w = (int(v) for v in grid_thw)
        if h % self.merge or w % self.merge:
            raise ConfigError(f"internvl: tile grid {h}x{w} not divisible by the merge factor {self.merge}")
        return t * (h // self.merge) * (w // self.merge)

    def forward_packed(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        grids = torch.as_tensor(grid_thw).reshape(-1, 3).tolist()
        tiles = pixel_values.shape[0]
        if pixel_values.dim() != 4 or sum(g[0] for g in grids) != tiles:
            raise EncodeFailed(
                f"internvl: pixel_values {tuple(pixel_values.shape)} disagree with grids {grids}"
            )
        h, w = pixel_values.shape[2] // self.patch[0], pixel_values.shape[3] // self.patch[1]
        exact = (h * self.patch[0], w * self.patch[1]) == tuple(pixel_values.shape[2:])
        if not exact or any((g[1], g[2]) != (h, w) for g in grids):
            raise EncodeFailed(f"internvl: grids {grids} disagree with {h}x{w}-patch tiles")
        total = sum(self.tokens_for_grid(g) for g in grids)
        if tiles == 0:
            return pixel_values.new_zeros((0, self.out_hidden)), None
        return self.forward(pixel_values).reshape(total, -1), None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[tiles, C, S, S]`` -> ``[tiles, tokens_per_tile, text_hidden]``."""
        vm = self.vision_tower
        h, w = pixel_values.shape[2] // self.patch[0], pixel_values.shape[3] // self.patch[1]
        x = vm.embeddings(pixel_values, h, w)
        for layer in vm.encoder.layer[: self.num_run]:
            x = layer(x)
        if self.final_norm:
            x = vm.layernorm(x)
        x = pixel_shuffle(x[:, 1:], h, w, self.merge)
        return self.multi_modal_projector(x)


class _HFReference(nn.Module):
    """transformers' own ``InternVLModel.get_image_features``, flattened to rows.

    Test-only: its state_dict keys equal ``InternVLVisionTower``'s, so
    ``ref.load_state_dict(tower.state_dict())`` shares the weights under test.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import InternVLModel

        model = InternVLModel(config)
        model.language_model = None  # the LM plays no part in image features
        self.vision_tower = model.vision_tower
        self.multi_modal_projector = model.multi_modal_projector
        self._model = [model]  # a list keeps it out of the module tree (no duplicate keys)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        model = self._model[0]
        out = model.get_image_features(pixel_values=pixel_values, return_dict=True).pooler_output
        return out.reshape(-1, out.shape[-1])


FAMILY = VisionFamily(
    name="internvl",
    model_types=("internvl",),
    # save_pretrained (transformers 5.x) writes the legacy names; in-memory HF state dicts carry "model."
    weight_prefixes=(
        ("vision_tower.", "vision_tower."),
        ("multi_modal_projector.", "multi_modal_projector."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ),
    build_tower=InternVLVisionTower,
    hf_reference=_HFReference,
)
