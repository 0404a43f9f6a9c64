# SPDX-License-Identifier: Apache-2.0
"""The reference tower equals transformers: bitwise alone or batch-invariant, to rounding packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from epd_encoder.errors import ConfigError
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.invariant import batch_invariant
from epd_encoder.models.registry import load_vision_model
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.preprocess.registry import load_preprocessor


def _hf_outputs(hf, family, item):
    """transformers' image features for one item alone: (embedding, deepstack list)."""
    if family == "internvl":
        ref = hf.model.get_image_features(pixel_values=item.pixel_values, return_dict=True)
        return ref.pooler_output.flatten(0, 1), []
    ref = hf.model.visual(item.pixel_values, grid_thw=torch.tensor([item.grid_thw]))
    return ref.pooler_output, list(getattr(ref, "deepstack_features", None) or [])


def _compare(out, want, deep, exact: bool):
    check = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    assert check(out.embedding, want)
    assert len(out.deepstack or ()) == len(deep)
    for got, w in zip(out.deepstack or (), deep):
        assert check(got, w)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl"])
def test_reference_tower_equals_transformers(family, tmp_path):
    """Alone: bitwise (the same module on the same input). --batch-invariant: bitwise
    against transformers under ``batch_invariant``. A default packed batch runs other
    GEMM shapes: equal to float rounding only."""
    d = write_tiny_model(family, tmp_path / family)
    loaded = load_vision_model(d, tower="reference", progress=False)
    pre = load_preprocessor(d)
    rng = np.random.default_rng(0)
    items = [pre.preprocess(Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)))
             for h, w in [(64, 64), (120, 200), (300, 90)]]
    packed = VisionExecutor(loaded.tower)
    invariant = VisionExecutor(loaded.tower, batch_invariant=True)
    hf = AutoModelForImageTextToText.from_pretrained(d).eval()
    with torch.inference_mode():
        wants = [_hf_outputs(hf, family, item) for item in items]
        with batch_invariant(hf):  # an InternVL item is several tiles: they run one by one
            wants_inv = [_hf_outputs(hf, family, item) for item in items]
        for item, (want, deep) in zip(items, wants):
            _compare(packed.encode([item])[0], want, deep, exact=True)
        for out, (want, deep) in zip(invariant.encode(items), wants_inv):
            _compare(out, want, deep, exact=True)
        for out, (want, deep) in zip(packed.encode(items), wants):
            _compare(out, want, deep, exact=False)
    if family == "qwen3_vl":
        assert len(wants[0][1]) > 0


def test_unknown_tower_kind(tmp_path):
    d = write_tiny_model("qwen2_vl", tmp_path / "m")
    with pytest.raises(ConfigError):
        load_vision_model(d, tower="turbo", progress=False)
