# SPDX-License-Identifier: Apache-2.0
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from epd_encoder.errors import BadAspectRatio, ConfigError, InvalidInput, UnsupportedModel
from epd_encoder.preprocess.base import DecodeLimits, ImagePreprocessor, load_preprocessor
from epd_encoder.preprocess.decode import decode_image, probe_image
from epd_encoder.preprocess.qwen import QwenPreprocessor, smart_resize

from .conftest import CORPUS, QWEN2_CONFIG, QWEN3_CONFIG, reference_image, reference_output, rgb_array

SMALL_MAX = {**QWEN2_CONFIG, "max_pixels": 128 * 28 * 28}  # exercises the downscale branch
LARGE_MIN = {**QWEN3_CONFIG, "size": {"shortest_edge": 512 * 512, "longest_edge": 1024 * 1024}}
CONFIGS = {"qwen2": QWEN2_CONFIG, "qwen3": QWEN3_CONFIG, "small_max": SMALL_MAX, "large_min": LARGE_MIN}
LIMITS = DecodeLimits()
# The largest images run only under the cheap configs to keep the suite fast.
HEAVY = {"png_rgb_1500x900", "png_rgb_10x1900", "png_rgb_2000x12"}


def _cases():
    for cname in CONFIGS:
        for iname in sorted(CORPUS):
            if iname in HEAVY and cname not in ("qwen2", "small_max"):
                continue
            yield cname, iname


def _assert_matches(out, ref, merge=2):
    rv = ref["pixel_values"]
    assert tuple(out.pixel_values.shape) == rv.shape
    assert out.pixel_values.dtype == torch.float32
    assert float(np.abs(out.pixel_values.numpy() - rv).max()) <= 1e-6
    assert list(out.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert out.num_tokens == out.num_patches // merge**2


@pytest.mark.parametrize("cname,iname", list(_cases()))
def test_matches_transformers(cname, iname):
    config = CONFIGS[cname]
    data = CORPUS[iname]
    ref = reference_output(Qwen2VLImageProcessorPil.from_dict(config), reference_image(data))
    pp = load_preprocessor(config, "qwen3_vl" if "qwen3" in cname else "qwen2_vl")
    out = pp.preprocess(decode_image(data, LIMITS))
    _assert_matches(out, ref)
    header = probe_image(data, LIMITS)
    assert pp.predict(header.width, header.height) == (out.grid_thw, out.num_tokens)


def test_auto_image_processor_checkpoint_dir(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_CONFIG))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    hf = AutoImageProcessor.from_pretrained(str(tmp_path))
    pp = load_preprocessor(tmp_path)
    assert isinstance(pp, ImagePreprocessor) and pp.patch_size == 16
    img = reference_image(CORPUS["jpeg_rgb_640x480"])
    _assert_matches(pp.preprocess(img), reference_output(hf, img))


def test_direct_pil_inputs_match():
    hf = Qwen2VLImageProcessorPil.from_dict(SMALL_MAX)
    pp = load_preprocessor(SMALL_MAX, "qwen2_5_vl")
    rgba = Image.fromarray(np.dstack([rgb_array(90, 60), rgb_array(90, 60, 1)[..., :1]]))
    for img in (rgba, rgba.convert("LA"), rgba.convert("P"), Image.fromarray(rgb_array(90, 60)[..., 0]).convert("I")):
        _assert_matches(pp.preprocess(img), reference_output(hf, img))


@pytest.mark.parametrize("cname", ["qwen2", "large_min"])
def test_device_path_equals_numpy_path(cname):
    pp = load_preprocessor(CONFIGS[cname], "qwen2_vl")
    img = decode_image(CORPUS["png_rgb_517x333"], LIMITS)
    staged = pp.stage(img)
    assert staged.pixels.dtype == torch.uint8
    host = pp.finish(staged)
    dev = pp.finish(staged, device="cpu")
    assert torch.equal(host.pixel_values, dev.pixel_values)
    assert dev.grid_thw == host.grid_thw and dev.num_tokens == host.num_tokens
    # uint8 without the temporal copies is 8x smaller than the fp32 pixel values.
    assert host.pixel_values.numel() * host.pixel_values.element_size() == 8 * staged.pixels.numel()


@given(
    h=st.integers(1, 6000),
    w=st.integers(1, 6000),
    factor=st.sampled_from([28, 32]),
    lo=st.integers(1, 2**18),
    span=st.integers(0, 2**24),
)
@settings(max_examples=400, deadline=None)
def test_smart_resize_arithmetic(h, w, factor, lo, span):
    hi = lo + span
    try:
        expected = hf_smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
    except ValueError:
        with pytest.raises(BadAspectRatio):
            smart_resize(h, w, factor, lo, hi)
        return
    got = smart_resize(h, w, factor, lo, hi)
    assert got == expected
    th, tw = got
    assert th % factor == 0 and tw % factor == 0 and th >= factor and tw >= factor
    if round(h / factor) * round(w / factor) * factor**2 > hi:
        assert th * tw <= hi or th == factor or tw == factor


def test_aspect_ratio_limit():
    pp = QwenPreprocessor()
    with pytest.raises(BadAspectRatio):
        pp.preprocess(Image.fromarray(rgb_array(402, 2)))
    with pytest.raises(BadAspectRatio):
        pp.predict(402, 2)
    assert pp.predict(400, 2)[0][0] == 1


def test_resolve_validates_overrides():
    pp = load_preprocessor(QWEN2_CONFIG, "qwen2_vl", pixel_bounds=(3136, 20_000_000))
    assert pp.resolve() == pp.params()
    p = pp.resolve(max_pixels=100_000)
    assert p["max_pixels"] == 100_000 and p["min_pixels"] == 3136 and p != pp.params()
    assert pp.resolve(max_pixels=20_000_000)["max_pixels"] == 20_000_000
    for bad in ({"min_pixels": 100}, {"max_pixels": 20_000_001}, {"min_pixels": 10_000, "max_pixels": 9_000},
                {"max_pixels": 1.5e6}, {"min_pixels": True}):
        with pytest.raises(InvalidInput):
            pp.resolve(**bad)
        with pytest.raises(InvalidInput):
            pp.preprocess(Image.fromarray(rgb_array(30, 30)), **bad)
    strict = load_preprocessor(QWEN2_CONFIG, "qwen2_vl")
    with pytest.raises(InvalidInput):
        strict.resolve(max_pixels=12845057)


def test_override_output_matches_reference_with_same_bounds():
    pp = load_preprocessor(QWEN2_CONFIG, "qwen2_vl")
    img = decode_image(CORPUS["png_rgb_1500x900"], LIMITS)
    out = pp.preprocess(img, max_pixels=200_000)
    ref = reference_output(Qwen2VLImageProcessorPil.from_dict({**QWEN2_CONFIG, "max_pixels": 200_000}), img)
    _assert_matches(out, ref)
    assert pp.predict(1500, 900, max_pixels=200_000) == (out.grid_thw, out.num_tokens)


def test_params_are_canonical_and_distinguish_pixels():
    base = load_preprocessor(QWEN2_CONFIG, "qwen2_vl").params()
    json.dumps(base)
    legacy = dict(QWEN2_CONFIG)
    sized = {k: v for k, v in legacy.items() if k not in ("min_pixels", "max_pixels")}
    sized["size"] = {"shortest_edge": 3136, "longest_edge": 12845056}
    assert load_preprocessor(sized, "qwen2_5_vl").params() == base
    variants = [
        {"patch_size": 16}, {"merge_size": 1}, {"temporal_patch_size": 1}, {"max_pixels": 1_000_000},
        {"min_pixels": 4000}, {"image_mean": [0.5, 0.5, 0.5]}, {"image_std": [0.5, 0.5, 0.5]},
        {"resample": 2}, {"do_normalize": False}, {"rescale_factor": 1 / 256}, {"do_convert_rgb": False},
    ]
    seen = [base]
    for change in variants:
        p = load_preprocessor({**QWEN2_CONFIG, **change}, "qwen2_vl").params()
        assert all(p != q for q in seen), change
        seen.append(p)


def test_unsupported_settings():
    with pytest.raises(ConfigError):
        load_preprocessor({**QWEN2_CONFIG, "do_resize": False}, "qwen2_vl")
    with pytest.raises(ConfigError):
        load_preprocessor({"size": {"shortest_edge": 10}}, "qwen2_vl")
    with pytest.raises(UnsupportedModel):
        load_preprocessor(QWEN2_CONFIG, "llava")
    with pytest.raises(ConfigError):
        load_preprocessor(QWEN2_CONFIG)
    with pytest.raises(ConfigError):  # the bounds must contain the config's own range
        load_preprocessor(QWEN2_CONFIG, "qwen2_vl", pixel_bounds=(4000, 20_000_000))
    pp = load_preprocessor({**QWEN2_CONFIG, "do_convert_rgb": False}, "qwen2_vl")
    with pytest.raises(InvalidInput):
        pp.preprocess(Image.fromarray(rgb_array(30, 30)).convert("L"))
