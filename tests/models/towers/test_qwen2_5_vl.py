# SPDX-License-Identifier: Apache-2.0
"""Qwen2.5-VL tower (window attention) vs transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLConfig

from epd_encoder.models.towers import qwen2_5_vl
from epd_encoder.models.towers.qwen2_5_vl import grid_windows
from epd_encoder.models.tiny import tiny_config
from tests.models.towers.test_qwen2_vl import (
    ATOL_BATCH,
    ATOL_REF,
    build_pair,
    max_diff,
    per_item,
    random_pixels,
)

# 22x18 patches = 11x9 merge units: 3x3 windows of 4 units a side, short last row and column.
MIXED = [(1, 8, 12), (1, 22, 18), (1, 4, 4), (1, 16, 16), (1, 8, 12), (2, 6, 10)]


def make_config(fullatt, depth=4):
    return Qwen2_5_VLConfig(
        vision_config={
            "depth": depth, "hidden_size": 64, "out_hidden_size": 48, "intermediate_size": 96, "num_heads": 4,
            "window_size": 112, "fullatt_block_indexes": list(fullatt),
        }
    )


def test_grid_windows_tile_the_merged_grid():
    units, lengths = grid_windows((1, 22, 18), merge=2, win=4)
    assert lengths.tolist() == [16, 16, 4, 16, 16, 4, 12, 12, 3]
    assert sorted(units.tolist()) == list(range(11 * 9))
    # First window: rows 0..3, columns 0..3 of the 9-wide merged grid, row-major.
    assert units[:16].tolist() == [r * 9 + c for r in range(4) for c in range(4)]


def test_grid_windows_per_frame():
    units, lengths = grid_windows((2, 8, 8), merge=2, win=4)
    assert lengths.tolist() == [16, 16]
    assert units[16:].min().item() == 16  # the second frame's windows hold only its own units


@pytest.mark.parametrize(
    "fullatt",
    [[1], [0, 3], [], [0, 1, 2, 3]],
    ids=["window-first-and-last", "full-first", "all-window", "all-full"],
)
@torch.inference_mode()
def test_packed_mixed_batch_matches_transformers(fullatt):
    cfg = make_config(fullatt)
    ref, ours = build_pair(qwen2_5_vl.FAMILY, cfg)
    pixels = random_pixels(cfg, MIXED)
    want = ref(pixels, grid_thw=torch.tensor(MIXED)).pooler_output
    got, deep = ours.forward_packed(pixels, torch.tensor(MIXED))
    assert deep is None
    assert want.abs().max() > 1e-2
    assert max_diff(got, want) <= ATOL_REF


@torch.inference_mode()
def test_batched_equals_per_image():
    cfg = make_config([1])
    _, ours = build_pair(qwen2_5_vl.FAMILY, cfg)
    pixels = random_pixels(cfg, MIXED, seed=4)
    batched, _ = ours.forward_packed(pixels, torch.tensor(MIXED))
    alone = torch.cat([e for e, _ in per_item(ours, pixels, MIXED)])
    assert max_diff(batched, alone) <= ATOL_BATCH


@torch.inference_mode()
def test_window_attention_is_local():
    # With only window layers, a patch in a far window cannot change the first window's rows.
    cfg = make_config([], depth=2)
    _, ours = build_pair(qwen2_5_vl.FAMILY, cfg)
    grid = (1, 16, 16)  # 8x8 merge units: 2x2 windows of 4x4 units
    pixels = random_pixels(cfg, [grid])
    first, _ = ours.forward_packed(pixels, torch.tensor([grid]))
    pixels[-4:] += 1.0  # the last merge unit lies in the last window
    second, _ = ours.forward_packed(pixels, torch.tensor([grid]))
    first_window = [r * 8 + c for r in range(4) for c in range(4)]
    assert max_diff(first[first_window], second[first_window]) <= ATOL_BATCH
    assert max_diff(first[-1:], second[-1:]) > 1e-4


@torch.inference_mode()
def test_tiny_config_matches_transformers():
    cfg = tiny_config("qwen2_5_vl")
    ref, ours = build_pair(qwen2_5_vl.FAMILY, cfg, seed=2)
    grids = [(1, 4, 4), (1, 32, 32), (1, 10, 26)]
    pixels = random_pixels(cfg, grids)
    want = ref(pixels, grid_thw=torch.tensor(grids)).pooler_output
    got, _ = ours.forward_packed(pixels, torch.tensor(grids))
    assert max_diff(got, want) <= ATOL_REF


@torch.inference_mode()
def test_bf16_close_to_fp32():
    cfg = make_config([1])
    _, ours = build_pair(qwen2_5_vl.FAMILY, cfg)
    pixels = random_pixels(cfg, MIXED[:3])
    want, _ = ours.forward_packed(pixels, torch.tensor(MIXED[:3]))
    got, _ = ours.to(torch.bfloat16).forward_packed(pixels, torch.tensor(MIXED[:3]))
    assert got.dtype == torch.bfloat16
    assert max_diff(got.float(), want) <= 0.05 * want.abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_cuda_matches_transformers(monkeypatch):
    # transformers' Conv3d patch embed would run in TF32 through cuDNN by default.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cfg = make_config([1])
    ref, ours = build_pair(qwen2_5_vl.FAMILY, cfg)
    ref, ours = ref.cuda(), ours.cuda()
    pixels = random_pixels(cfg, MIXED).cuda()
    grid = torch.tensor(MIXED)
    with torch.inference_mode():
        want = ref(pixels, grid_thw=grid.cuda()).pooler_output
        got, _ = ours.forward_packed(pixels, grid)
        assert max_diff(got, want) <= ATOL_REF
        ref, ours = ref.bfloat16(), ours.bfloat16()
        want = ref(pixels, grid_thw=grid.cuda()).pooler_output.float()
        got = ours.forward_packed(pixels, grid)[0].float()
    assert max_diff(got, want) <= 0.05 * want.abs().max().item()
