# SPDX-License-Identifier: Apache-2.0
"""Qwen3-VL tower (interpolated positions, deepstack) vs transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
)
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from epd_encoder.models.towers import qwen3_vl
from epd_encoder.models.towers.qwen3_vl import bilinear_taps
from epd_encoder.models.tiny import tiny_config
from tests.models.towers.test_qwen2_vl import (
    ATOL_BATCH,
    ATOL_REF,
    build_pair,
    max_diff,
    per_item,
    random_pixels,
)

MIXED = [(1, 8, 12), (1, 22, 18), (1, 4, 4), (1, 8, 12), (2, 6, 10), (1, 2, 30)]


@pytest.fixture(scope="module")
def config():
    return Qwen3VLConfig(
        vision_config={
            "depth": 3, "hidden_size": 64, "out_hidden_size": 48, "intermediate_size": 96, "num_heads": 4,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 2],
        }
    )


@pytest.fixture(scope="module")
def pair(config):
    return build_pair(qwen3_vl.FAMILY, config)


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 22, 18), (2, 2, 30), (1, 8, 8)])
def test_bilinear_taps_match_transformers_helper(grid):
    idx, wts = bilinear_taps(grid, merge=2, side=8)
    ref_idx, ref_wts = get_vision_interpolation_indices_and_weights(
        torch.tensor([grid]), 8, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    table = torch.randn(64, 5, dtype=torch.float64)
    ours = (table[idx] * wts[..., None].double()).sum(1)
    theirs = (table[ref_idx] * ref_wts[..., None].double()).sum(1)
    assert torch.allclose(ours, theirs, atol=1e-6)


@torch.inference_mode()
def test_packed_mixed_batch_matches_transformers(config, pair):
    ref, ours = pair
    pixels = random_pixels(config, MIXED)
    want = ref(pixels, grid_thw=torch.tensor(MIXED))
    got, deep = ours.forward_packed(pixels, torch.tensor(MIXED))
    assert max_diff(got, want.pooler_output) <= ATOL_REF
    assert deep is not None and len(deep) == len(want.deepstack_features) == 2
    for d, w in zip(deep, want.deepstack_features):
        assert w.abs().max() > 1e-2
        assert max_diff(d, w) <= ATOL_REF


@torch.inference_mode()
def test_batched_equals_per_image_with_deepstack(config, pair):
    _, ours = pair
    pixels = random_pixels(config, MIXED, seed=7)
    batched, deep = ours.forward_packed(pixels, torch.tensor(MIXED))
    alone = per_item(ours, pixels, MIXED)
    assert max_diff(batched, torch.cat([e for e, _ in alone])) <= ATOL_BATCH
    for j, d in enumerate(deep):
        assert max_diff(d, torch.cat([ds[j] for _, ds in alone])) <= ATOL_BATCH


@torch.inference_mode()
def test_position_table_changes_output(config, pair):
    # The learned grid really feeds the forward (an all-zero table must change the result).
    _, ours = pair
    pixels = random_pixels(config, [(1, 8, 8)])
    before, _ = ours.forward_packed(pixels, torch.tensor([[1, 8, 8]]))
    saved = ours.pos_embed.weight.clone()
    ours.pos_embed.weight.zero_()
    try:
        after, _ = ours.forward_packed(pixels, torch.tensor([[1, 8, 8]]))
    finally:
        ours.pos_embed.weight.copy_(saved)
    assert max_diff(before, after) > 1e-4


@torch.inference_mode()
def test_tiny_config_matches_transformers():
    cfg = tiny_config("qwen3_vl")
    ref, ours = build_pair(qwen3_vl.FAMILY, cfg, seed=3)
    grids = [(1, 4, 4), (1, 28, 28), (1, 12, 20)]
    pixels = random_pixels(cfg, grids)
    want = ref(pixels, grid_thw=torch.tensor(grids))
    got, deep = ours.forward_packed(pixels, torch.tensor(grids))
    assert max_diff(got, want.pooler_output) <= ATOL_REF
    for d, w in zip(deep, want.deepstack_features, strict=True):
        assert max_diff(d, w) <= ATOL_REF


def test_tokens_for_grid(pair):
    _, ours = pair
    assert ours.tokens_for_grid((1, 28, 28)) == 196


@pytest.mark.parametrize(
    ("config_cls", "deepstack"),
    [(Qwen3VLMoeConfig, [1]), (Qwen3_5Config, None), (Qwen3_5MoeConfig, None)],
    ids=["qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"],
)
@torch.inference_mode()
def test_variants_match_their_transformers_modules(config_cls, deepstack):
    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 24, "intermediate_size": 48, "num_heads": 2,
              "num_position_embeddings": 64}
    if deepstack is not None:
        vision["deepstack_visual_indexes"] = deepstack
    cfg = config_cls(vision_config=vision)
    assert cfg.model_type in qwen3_vl.FAMILY.model_types
    ref, ours = build_pair(qwen3_vl.FAMILY, cfg)
    grids = MIXED[:3]
    pixels = random_pixels(cfg, grids)
    want = ref(pixels, grid_thw=torch.tensor(grids))
    got, deep = ours.forward_packed(pixels, torch.tensor(grids))
    assert max_diff(got, want.pooler_output) <= ATOL_REF
    if deepstack is None:
        assert deep is None
    else:
        assert max_diff(deep[0], want.deepstack_features[0]) <= ATOL_REF
