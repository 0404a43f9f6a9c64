# SPDX-License-Identifier: Apache-2.0
"""Family registry and loading a vision model from a checkpoint directory."""

from __future__ import annotations

import json

import pytest
import torch

from epd_encoder.errors import CheckpointError, ConfigError, UnsupportedModel
from epd_encoder.models.base import VisionFamily, VisionTower
from epd_encoder.models.registry import (
    get_family,
    load_vision_model,
    resolve_dtype,
    supported_model_types,
)
from epd_encoder.models.tiny import write_tiny_model
from tests.models.towers.test_qwen2_vl import max_diff, random_pixels

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.mark.parametrize("model_type", [*QWEN, "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "internvl", "kimi_k25"])
def test_get_family(model_type):
    family = get_family(model_type)
    assert isinstance(family, VisionFamily)
    assert model_type in family.model_types
    assert family.weight_prefixes


def test_unsupported_model_lists_supported_types():
    with pytest.raises(UnsupportedModel) as info:
        get_family("llava")
    assert isinstance(info.value, ConfigError)
    for name in supported_model_types():
        assert name in info.value.message
    assert set(supported_model_types()) == {*QWEN, "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "internvl", "kimi_k25"}


def test_resolve_dtype():
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(ConfigError, match="dtype"):
        resolve_dtype("int8", "cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: write_tiny_model(f, root / f, seed=0) for f in QWEN}


def _hf_visual(ckpt):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).model.visual.eval()


@pytest.mark.parametrize("model_type", QWEN)
@torch.inference_mode()
def test_load_vision_model_matches_transformers_loading(checkpoints, model_type):
    ckpt = checkpoints[model_type]
    loaded = load_vision_model(ckpt, progress=False)
    tower = loaded.tower
    assert loaded.family.name == model_type
    assert loaded.model_id == model_type and loaded.dtype == torch.float32
    assert isinstance(tower, VisionTower) and not tower.training
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in tower.parameters())

    ref = _hf_visual(ckpt)
    grids = [(1, 4, 4), (1, 8, 12)]
    pixels = random_pixels(loaded.hf_config, grids)
    want = ref(pixels, grid_thw=torch.tensor(grids))
    got, deep = tower.forward_packed(pixels, torch.tensor(grids))
    assert max_diff(got, want.pooler_output) <= 1e-4
    if model_type == "qwen3_vl":
        for d, w in zip(deep, want.deepstack_features, strict=True):
            assert max_diff(d, w) <= 1e-4


def test_load_vision_model_dtype(checkpoints):
    loaded = load_vision_model(checkpoints["qwen2_5_vl"], dtype="bf16", model_id="m@rev", progress=False)
    assert loaded.model_id == "m@rev"
    assert {p.dtype for p in loaded.tower.parameters()} == {torch.bfloat16}


def test_config_disagreeing_with_weights_raises_checkpoint_error(checkpoints, tmp_path):
    ckpt = write_tiny_model("qwen2_vl", tmp_path / "deeper")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["vision_config"]["depth"] += 1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing"):
        load_vision_model(ckpt, progress=False)


def test_unsupported_checkpoint(tmp_path):
    ckpt = write_tiny_model("qwen2_vl", tmp_path / "other")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "qwen2"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="qwen2_5_vl"):
        load_vision_model(ckpt, progress=False)
