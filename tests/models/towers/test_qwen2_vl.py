# SPDX-License-Identifier: Apache-2.0
"""Qwen2-VL tower vs transformers' vision module on the same weights.

The helpers here (``build_pair``, ``random_pixels``, ``per_item``) are shared by
the other Qwen tower tests.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2VLConfig

from epd_encoder.errors import EncodeFailed
from epd_encoder.models.towers import qwen2_vl
from epd_encoder.models.loading.loader import load_strict
from epd_encoder.models.tiny import tiny_config

ATOL_REF = 1e-4
ATOL_BATCH = 1e-5


def build_pair(family, config, seed: int = 0):
    """(transformers reference, our tower) in eval mode, ours loaded strictly from the reference."""
    torch.manual_seed(seed)
    ref = family.hf_reference(config).eval()
    ours = family.build_tower(config).eval()
    load_strict(ours, ref.state_dict())
    return ref, ours


def random_pixels(config, grids, seed: int = 1) -> torch.Tensor:
    v = config.vision_config
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(math.prod(x) for x in grids), width, generator=g)


def per_item(tower, pixels, grids):
    """Each item alone through ``forward_packed``: list of (embedding, deepstack)."""
    out, start = [], 0
    for grid in grids:
        n = math.prod(grid)
        out.append(tower.forward_packed(pixels[start : start + n], torch.tensor([grid])))
        start += n
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


MIXED = [(1, 8, 12), (1, 22, 18), (1, 4, 4), (1, 8, 12), (2, 6, 10)]


@pytest.fixture(scope="module")
def config():
    return Qwen2VLConfig(
        vision_config={"depth": 2, "embed_dim": 64, "hidden_size": 48, "num_heads": 4, "mlp_ratio": 2}
    )


@pytest.fixture(scope="module")
def pair(config):
    return build_pair(qwen2_vl.FAMILY, config)


def test_state_dict_names_match_reference(pair):
    ref, ours = pair
    assert set(ours.state_dict()) == set(ref.state_dict())


@torch.inference_mode()
def test_packed_mixed_batch_matches_transformers(config, pair):
    ref, ours = pair
    pixels = random_pixels(config, MIXED)
    want = ref(pixels, grid_thw=torch.tensor(MIXED)).pooler_output
    got, deep = ours.forward_packed(pixels, torch.tensor(MIXED))
    assert deep is None
    assert got.shape == (sum(ours.tokens_for_grid(g) for g in MIXED), 48)
    assert want.abs().max() > 1e-2  # a meaningful signal, not all zeros
    assert max_diff(got, want) <= ATOL_REF


@torch.inference_mode()
def test_batched_equals_per_image(config, pair):
    _, ours = pair
    pixels = random_pixels(config, MIXED, seed=3)
    batched, _ = ours.forward_packed(pixels, torch.tensor(MIXED))
    alone = torch.cat([e for e, _ in per_item(ours, pixels, MIXED)])
    assert max_diff(batched, alone) <= ATOL_BATCH


@torch.inference_mode()
def test_items_do_not_see_each_other(config, pair):
    _, ours = pair
    grids = [(1, 8, 8), (1, 8, 8)]
    pixels = random_pixels(config, grids)
    first, _ = ours.forward_packed(pixels, torch.tensor(grids))
    pixels[64:] = torch.randn(64, pixels.shape[1])
    second, _ = ours.forward_packed(pixels, torch.tensor(grids))
    assert max_diff(first[:16], second[:16]) <= ATOL_BATCH
    assert max_diff(first[16:], second[16:]) > 1e-3


def test_tokens_for_grid(pair):
    _, ours = pair
    assert ours.tokens_for_grid((1, 8, 12)) == 24
    assert ours.tokens_for_grid((2, 6, 10)) == 30


def test_rejects_grid_that_disagrees_with_pixels(config, pair):
    _, ours = pair
    pixels = random_pixels(config, [(1, 4, 4)])
    with pytest.raises(EncodeFailed, match="rows"):
        ours.forward_packed(pixels, torch.tensor([[1, 4, 6]]))
    with pytest.raises(EncodeFailed, match="merge"):
        ours.forward_packed(pixels[:12], torch.tensor([[1, 3, 4]]))


@torch.inference_mode()
def test_tiny_config_matches_transformers():
    cfg = tiny_config("qwen2_vl")
    ref, ours = build_pair(qwen2_vl.FAMILY, cfg, seed=5)
    grids = [(1, 4, 4), (1, 32, 20)]
    pixels = random_pixels(cfg, grids)
    want = ref(pixels, grid_thw=torch.tensor(grids)).pooler_output
    got, _ = ours.forward_packed(pixels, torch.tensor(grids))
    assert max_diff(got, want) <= ATOL_REF


@torch.inference_mode()
def test_grid_tables_are_cached(config, pair):
    _, ours = pair
    ours._grid_cache = type(ours._grid_cache)(capacity=2)
    pixels = random_pixels(config, [(1, 4, 4)])
    for _ in range(3):
        ours.forward_packed(pixels, torch.tensor([[1, 4, 4]]))
    assert len(ours._grid_cache) == 1
    for g in [(1, 4, 8), (1, 8, 4)]:
        ours.forward_packed(random_pixels(config, [g]), torch.tensor([g]))
    assert len(ours._grid_cache) == 2  # bounded: the oldest grid was evicted
