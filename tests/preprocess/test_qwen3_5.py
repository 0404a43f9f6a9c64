# SPDX-License-Identifier: Apache-2.0
"""Qwen3.5 / Qwen3.5-MoE images: transformers maps both to the Qwen2-VL image processor
(patch 16, mean/std 0.5, as Qwen3-VL); ours must equal it bitwise on both backends."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from epd_encoder.models.tiny import image_processor_config
from epd_encoder.preprocess.base import DecodeLimits
from epd_encoder.preprocess.decode import decode_image, probe_image
from epd_encoder.preprocess.registry import load_preprocessor

from . import tv_reference
from .conftest import CORPUS, QWEN3_CONFIG, reference_image, reference_output

MODEL_TYPES = ["qwen3_5", "qwen3_5_moe"]
TINY = {k: v for k, v in image_processor_config("qwen3_5").items()}
CONFIGS = {"real": QWEN3_CONFIG, "tiny": TINY}
IMAGES = sorted(n for n in CORPUS if n not in {"png_rgb_1500x900", "png_rgb_10x1900", "png_rgb_2000x12"})
LIMITS = DecodeLimits()


@pytest.fixture(scope="module")
def tv_ref():
    """transformers' torchvision processor as AutoImageProcessor picks it for each model type."""
    if reason := tv_reference.missing_reason():
        pytest.skip(reason)
    jobs = [{"name": f"{mt}/{c}", "processor": "auto", "images": IMAGES,
             "config": {"preprocessor": cfg, "model": {"model_type": mt}}}
            for mt in MODEL_TYPES for c, cfg in CONFIGS.items()]
    outputs, classes = tv_reference.run_reference(jobs, CORPUS)
    return outputs, classes


def _assert_equal(out, pixel_values, grid):
    pv = torch.as_tensor(pixel_values)
    assert torch.equal(out.pixel_values, pv), f"max |diff| {(out.pixel_values - pv).abs().max()}"
    assert list(out.grid_thw) == torch.as_tensor(grid).reshape(-1, 3)[0].tolist()
    assert out.num_tokens == out.num_patches // 4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("cname", sorted(CONFIGS))
def test_torchvision_backend_equals_auto_image_processor(model_type, cname, tv_ref):
    outputs, classes = tv_ref
    assert classes[f"{model_type}/{cname}"] == "Qwen2VLImageProcessor"
    pp = load_preprocessor(CONFIGS[cname], model_type)
    assert pp.params()["patch_size"] == 16 and pp.params()["backend"] == "torchvision"
    for name in IMAGES:
        out = pp.preprocess(decode_image(CORPUS[name], LIMITS))
        _assert_equal(out, *outputs[f"{model_type}/{cname}"][name])
        header = probe_image(CORPUS[name], LIMITS)
        assert pp.predict(header.width, header.height) == (out.grid_thw, out.num_tokens)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_pil_backend_equals_auto_image_processor(model_type, tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(TINY))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    hf = AutoImageProcessor.from_pretrained(str(tmp_path))  # no torchvision here: the PIL class
    assert type(hf) is Qwen2VLImageProcessorPil
    pp = load_preprocessor(tmp_path, backend="pil")
    for name in IMAGES:
        ref = reference_output(hf, reference_image(CORPUS[name]))
        _assert_equal(pp.preprocess(decode_image(CORPUS[name], LIMITS)), ref["pixel_values"], ref["image_grid_thw"])
    ref = reference_output(Qwen2VLImageProcessorPil.from_dict(QWEN3_CONFIG), reference_image(CORPUS["png_rgb_517x333"]))
    real = load_preprocessor(QWEN3_CONFIG, model_type, backend="pil")
    _assert_equal(real.preprocess(decode_image(CORPUS["png_rgb_517x333"], LIMITS)), ref["pixel_values"],
                  ref["image_grid_thw"])
