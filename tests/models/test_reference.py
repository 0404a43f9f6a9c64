# SPDX-License-Identifier: Apache-2.0
"""The reference tower is bit-identical to transformers, packed or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from epd_encoder.errors import ConfigError
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.registry import load_vision_model
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.preprocess.base import load_preprocessor


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl"])
def test_reference_tower_equals_transformers_bitwise(family, tmp_path):
    d = write_tiny_model(family, tmp_path / family)
    loaded = load_vision_model(d, tower="reference", progress=False)
    pre = load_preprocessor(d)
    rng = np.random.default_rng(0)
    items = [pre.preprocess(Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)))
             for h, w in [(64, 64), (120, 200), (300, 90)]]
    outs = VisionExecutor(loaded.tower).encode(items)  # one packed forward
    hf = AutoModelForImageTextToText.from_pretrained(d).eval()
    with torch.inference_mode():
        for item, out in zip(items, outs):
            if family == "internvl":
                ref = hf.model.get_image_features(pixel_values=item.pixel_values, return_dict=True)
                assert torch.equal(out.embedding, ref.pooler_output.flatten(0, 1))
                continue
            ref = hf.model.visual(item.pixel_values, grid_thw=torch.tensor([item.grid_thw]))
            assert torch.equal(out.embedding, ref.pooler_output)
            if family == "qwen3_vl":
                assert len(out.deepstack) == len(ref.deepstack_features) > 0
                for got, want in zip(out.deepstack, ref.deepstack_features):
                    assert torch.equal(got, want)


def test_unknown_tower_kind(tmp_path):
    d = write_tiny_model("qwen2_vl", tmp_path / "m")
    with pytest.raises(ConfigError):
        load_vision_model(d, tower="turbo", progress=False)
