# SPDX-License-Identifier: Apache-2.0
"""Qwen3.5 (dense and MoE) end to end from a tiny checkpoint: the Qwen3-VL tower without deepstack.

The tower math is shared with Qwen3-VL (tests/models/towers/test_qwen3_vl.py checks it against
each transformers module); here the served path is checked from files: only vision
tensors are read, the fast tower equals transformers' own ``model.visual`` on the
checkpoint's weights, a packed batch equals its items alone, and ``--batch-invariant``
is bitwise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.loading.loader import load_vision_weights
from epd_encoder.models.registry import get_family, load_vision_model
from epd_encoder.models.tiny import CHECKPOINT_VISION_PREFIXES, tiny_config, write_tiny_model
from epd_encoder.preprocess.registry import load_preprocessor

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
SIZES = [(64, 64), (120, 200), (300, 90), (448, 448)]


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    return request.param, write_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "m", num_shards=3)


def _items(d):
    pre = load_preprocessor(d)
    rng = np.random.default_rng(3)
    return [pre.preprocess(Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))) for h, w in SIZES]


def test_tiny_config_is_hybrid_and_has_no_deepstack(ckpt):
    family, d = ckpt
    cfg = tiny_config(family)
    assert set(cfg.text_config.layer_types) == {"linear_attention", "full_attention"}
    assert not getattr(cfg.vision_config, "deepstack_visual_indexes", None)
    assert cfg.vision_config.patch_size == 16
    pre = json.loads((d / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor"
    assert pre["patch_size"] == 16 and pre["image_mean"] == pre["image_std"] == [0.5, 0.5, 0.5]
    video = json.loads((d / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor" and video["max_frames"] <= 16


def test_loader_reads_only_vision_tensors(ckpt):
    family, d = ckpt
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    vision = {k for k in weight_map if k.startswith(CHECKPOINT_VISION_PREFIXES[family])}
    lm_files = {weight_map[k] for k in weight_map if k not in vision}
    state, report = load_vision_weights(d, get_family(family).weight_prefixes, progress=False)
    assert len(state) == len(vision) > 20
    assert set(report.shards_skipped) == lm_files and not lm_files & set(report.shards_opened)
    assert any("linear_attn" in k for k in weight_map)  # the hybrid LM really is in the files


@torch.inference_mode()
def test_fast_tower_equals_transformers_and_batch_equals_alone(ckpt):
    from transformers import AutoModelForImageTextToText

    family, d = ckpt
    loaded = load_vision_model(d, progress=False)
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    items = _items(d)
    pixels = torch.cat([it.pixel_values for it in items])
    grid = torch.tensor([it.grid_thw for it in items])
    want = hf.model.visual(pixels, grid_thw=grid)
    assert getattr(want, "deepstack_features", None) in (None, [], ())
    outs = VisionExecutor(loaded.tower).encode(items)
    got = torch.cat([o.embedding for o in outs])
    assert want.pooler_output.abs().max() > 1e-2
    assert (got - want.pooler_output).abs().max().item() <= 1e-4
    assert all(o.deepstack is None for o in outs)
    alone = [VisionExecutor(loaded.tower).encode([it])[0].embedding for it in items]
    assert (got - torch.cat(alone)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_is_bitwise(ckpt, dtype):
    _, d = ckpt
    loaded = load_vision_model(d, dtype=dtype, progress=False)
    ex = VisionExecutor(loaded.tower, dtype=dtype, batch_invariant=True)
    items = [type(it)(it.pixel_values.to(dtype), it.grid_thw, it.num_tokens) for it in _items(d)]
    alone = [ex.encode([it])[0].embedding for it in items]
    for order in ([0, 1, 2, 3], [3, 1, 0, 2, 2]):
        for i, out in zip(order, ex.encode([items[i] for i in order])):
            assert torch.equal(out.embedding, alone[i])
