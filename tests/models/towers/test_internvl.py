# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLModel

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.models.base import VisionTower
from epd_encoder.models.towers.internvl import FAMILY, InternVLVisionTower, pixel_shuffle


PATCH, SIZE = 8, 64  # 8x8 patch grid per tile -> 16 tokens per tile at ratio 0.5


def tiny_config(top: dict | None = None, **vision) -> InternVLConfig:
    vc = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=SIZE,
        patch_size=PATCH,
    )
    vc.update(vision)
    tc = dict(
        model_type="qwen2",
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=128,
    )
    return InternVLConfig(vision_config=vc, text_config=tc, image_token_id=5, **(top or {}))


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    # HF init leaves cls/pos embeddings at zero and norms at one: randomize so every weight matters
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:  # norms, biases, layer scales
                p.copy_(0.5 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel() if p.shape[0] > 1 else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


def pair(config: InternVLConfig) -> tuple[InternVLVisionTower, torch.nn.Module]:
    ref = FAMILY.hf_reference(config).eval()
    randomize(ref)
    tower = FAMILY.build_tower(config).eval()
    tower.load_state_dict(ref.state_dict(), strict=True)
    return tower, ref


def pixels(tiles: int, size: int = SIZE, seed: int = 1) -> torch.Tensor:
    return torch.randn(tiles, 3, size, size, generator=torch.Generator().manual_seed(seed))


def strip(keys, prefixes) -> dict[str, str]:
    out = {}
    for k in keys:
        for ckpt, mod in prefixes:
            if k.startswith(ckpt):
                out[k] = mod + k[len(ckpt):]
                break
    return out


VARIANTS = {
    "default": ({}, {}),
    "qknorm-rms-finalnorm-mask": ({}, dict(use_qk_norm=True, norm_type="rms_norm", use_mean_pooling=False,
                                         use_mask_token=True, attention_bias=True)),
    "feature-layer-minus2": (dict(vision_feature_layer=-2), dict(use_mean_pooling=False)),
    "feature-layer-1": (dict(vision_feature_layer=1), dict(num_hidden_layers=3)),
    "ratio-quarter": (dict(downsample_ratio=0.25, projector_hidden_act="gelu_pytorch_tanh"), {}),
    "interpolated-pos": ({}, dict(image_size=48)),  # 64-px tiles on a 48-px position table
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_transformers_get_image_features(name):
    top, vision = VARIANTS[name]
    tower, ref = pair(tiny_config(top, **vision))
    x = pixels(3)
    grid = torch.tensor([[3, SIZE // PATCH, SIZE // PATCH]])
    with torch.no_grad():
        ours, deepstack = tower.forward_packed(x, grid)
        theirs = ref(x)
    assert deepstack is None
    assert ours.shape == theirs.shape == (tower.tokens_for_grid(grid[0].tolist()), 48)
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_reference_is_sensitive_to_weights():
    # guards the comparison above: a perturbed weight must be visible in the output
    tower, ref = pair(tiny_config())
    x = pixels(2)
    with torch.no_grad():
        before = tower(x).clone()
        tower.vision_tower.embeddings.position_embeddings[0, 5] += 1.0
        after = tower(x)
    assert (before - after).abs().max().item() > 1e-3


def test_packed_equals_per_item():
    tower, _ = pair(tiny_config())
    g = SIZE // PATCH
    counts = [1, 3, 2, 1]
    items = [pixels(n, seed=10 + i) for i, n in enumerate(counts)]
    grids = torch.tensor([[n, g, g] for n in counts])
    with torch.no_grad():
        packed, _ = tower.forward_packed(torch.cat(items), grids)
        singles = [tower.forward_packed(x, grids[i : i + 1])[0] for i, x in enumerate(items)]
    rows = [tower.tokens_for_grid(gr.tolist()) for gr in grids]
    assert rows == [n * (g // 2) ** 2 for n in counts]
    assert packed.shape[0] == sum(rows)
    for got, want in zip(packed.split(rows), singles):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-5


def test_checkpoint_prefixes_load_strictly(tmp_path):
    config = tiny_config(None, use_mean_pooling=False, use_qk_norm=True)
    InternVLForConditionalGeneration(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    renamed = strip(saved, FAMILY.weight_prefixes)
    assert not any("language_model" in k or "lm_head" in k for k in renamed)
    tower = FAMILY.build_tower(config)
    assert set(renamed.values()) == set(tower.state_dict())
    tower.load_state_dict({new: saved[old] for old, new in renamed.items()}, strict=True)


def test_in_memory_model_prefix_loads_strictly():
    config = tiny_config()
    sd = InternVLModel(config).state_dict()  # keys without the "model." of the CausalLM wrapper
    full = {"model." + k: v for k, v in sd.items()}
    renamed = strip(full, FAMILY.weight_prefixes)
    tower = FAMILY.build_tower(config)
    tower.load_state_dict({new: full[old] for old, new in renamed.items()}, strict=True)


def test_missing_key_fails_strict_load():
    config = tiny_config()
    ref = FAMILY.hf_reference(config)
    sd = ref.state_dict()
    del sd["vision_tower.encoder.layer.1.attention.k_proj.weight"]
    with pytest.raises(RuntimeError, match="k_proj"):
        FAMILY.build_tower(config).load_state_dict(sd, strict=True)


def test_pixel_shuffle_matches_transformers():
    x = torch.randn(2, 8, 8, 12)
    for ratio, k in ((0.5, 2), (0.25, 4)):
        want = InternVLModel.pixel_shuffle(None, x, scale_factor=ratio).reshape(2, -1, 12 * k * k)
        got = pixel_shuffle(x.reshape(2, 64, 12), 8, 8, k)
        assert torch.equal(got, want)


def test_tokens_for_grid_and_bad_grids():
    tower = FAMILY.build_tower(tiny_config())
    assert tower.tokens_for_grid((5, 8, 8)) == 80
    with pytest.raises(ConfigError):
        tower.tokens_for_grid((1, 7, 8))
    with pytest.raises(EncodeFailed):  # grids claim 3 tiles, 2 given
        tower.forward_packed(pixels(2), torch.tensor([[3, 8, 8]]))
    with pytest.raises(EncodeFailed):  # grid disagrees with the tile size
        tower.forward_packed(pixels(2), torch.tensor([[2, 4, 4]]))
    with pytest.raises(EncodeFailed):  # tile size not a whole number of patches
        tower.forward_packed(pixels(1, size=SIZE + 1), torch.tensor([[1, 8, 8]]))
    out, _ = tower.forward_packed(torch.zeros(0, 3, SIZE, SIZE), torch.zeros(0, 3, dtype=torch.long))
    assert out.shape == (0, 48)


def test_family_and_unsupported_configs():
    assert FAMILY.name == "internvl" and FAMILY.model_types == ("internvl",)
    assert isinstance(FAMILY.build_tower(tiny_config()), VisionTower)
    with pytest.raises(ConfigError):
        FAMILY.build_tower(tiny_config(dict(vision_feature_select_strategy="full")))
    bad = tiny_config()
    bad.vision_feature_layer = [-1, -2]
    with pytest.raises(ConfigError):
        FAMILY.build_tower(bad)


def test_bfloat16_with_interpolated_positions_tracks_fp32():
    config = tiny_config(None, image_size=48)
    tower, _ = pair(config)
    x = pixels(2)
    with torch.no_grad():
        want = tower(x)
        got = tower.to(torch.bfloat16)(x.to(torch.bfloat16)).float()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_tiny_checkpoint_through_loader_matches_from_pretrained(tmp_path):
    from epd_encoder.models.loading.loader import load_strict, load_vision_weights
    from epd_encoder.models.tiny import write_tiny_model

    ckpt = write_tiny_model("internvl", tmp_path / "ckpt", seed=3, num_shards=3)
    hf = InternVLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    state, _ = load_vision_weights(ckpt, FAMILY.weight_prefixes, progress=False)
    tower = FAMILY.build_tower(hf.config).eval()
    load_strict(tower, state)
    x = pixels(2, size=448)
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=x, return_dict=True).pooler_output
        got, _ = tower.forward_packed(x, torch.tensor([[2, 32, 32]]))
    assert got.shape == (2 * 256, hf.config.text_config.hidden_size)
    assert (got - want.reshape(got.shape)).abs().max().item() <= 1e-4
