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

from epd_encoder import content_key
from epd_encoder.errors import BadAspectRatio, ConfigError, InvalidInput, UnsupportedModel
from epd_encoder.preprocess.base import DecodeLimits, ImagePreprocessor
from epd_encoder.preprocess.decode import decode_image, probe_image
from epd_encoder.preprocess.qwen import QwenPreprocessor, smart_resize
from epd_encoder.preprocess.registry import load_preprocessor

from . import tv_reference
from .conftest import CORPUS, QWEN2_CONFIG, QWEN3_CONFIG, reference_image, reference_output, rgb_array

SMALL_MAX = {**QWEN2_CONFIG, "max_pixels": 128 * 28 * 28}  # exercises the downscale branch
LARGE_MIN = {**QWEN3_CONFIG, "size": {"shortest_edge": 512 * 512, "longest_edge": 1024 * 1024}}
CONFIGS = {"qwen2": QWEN2_CONFIG, "qwen3": QWEN3_CONFIG, "small_max": SMALL_MAX, "large_min": LARGE_MIN}
# Every family: Qwen2.5-VL ships Qwen2-VL's processor config; the model type is what differs.
MODEL_TYPES = {"qwen2": "qwen2_vl", "small_max": "qwen2_5_vl", "qwen3": "qwen3_vl", "large_min": "qwen3_vl"}
# Settings no checkpoint above uses, each on a few images, torchvision backend only.
VARIANTS = {
    "bilinear": {**SMALL_MAX, "resample": 2},
    "lanczos": {**SMALL_MAX, "resample": 1},
    "nearest": {**SMALL_MAX, "resample": 0},
    "no_rescale": {**SMALL_MAX, "do_rescale": False},
    "no_normalize": {**SMALL_MAX, "do_normalize": False},
    "odd_scale": {**SMALL_MAX, "rescale_factor": 1 / 256, "image_mean": 0.5, "image_std": 0.25},
    "override": {**QWEN2_CONFIG, "max_pixels": 200_000},
}
VARIANT_IMAGES = ["png_rgb_1x1", "png_rgb_13x7", "png_rgb_517x333", "png_rgb_2000x12", "png_rgba", "jpeg_exif_6"]
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
    rv = torch.as_tensor(ref["pixel_values"])
    assert out.pixel_values.dtype == torch.float32
    assert torch.equal(out.pixel_values, rv), f"max |diff| {(out.pixel_values - rv).abs().max()}"
    assert list(out.grid_thw) == torch.as_tensor(ref["image_grid_thw"])[0].tolist()
    assert out.num_tokens == out.num_patches // merge**2


@pytest.fixture(scope="module")
def tv_ref():
    """Outputs of transformers' torchvision-backend Qwen2VLImageProcessor, from one child process."""
    if reason := tv_reference.missing_reason():
        pytest.skip(reason)
    jobs = [{"name": c, "processor": "qwen2_vl", "config": CONFIGS[c], "images": [i for n, i in _cases() if n == c]}
            for c in CONFIGS]
    jobs += [{"name": v, "processor": "qwen2_vl", "config": cfg, "images": VARIANT_IMAGES}
             for v, cfg in VARIANTS.items()]
    auto = {"preprocessor": QWEN3_CONFIG, "model": {"model_type": "qwen3_vl"}}
    jobs.append({"name": "auto", "processor": "auto", "config": auto, "images": ["jpeg_rgb_640x480"]})
    outputs, classes = tv_reference.run_reference(jobs, CORPUS)
    return {**outputs, "classes": classes}


def _tv_output(tv_ref, cname, iname):
    pixel_values, grid = tv_ref[cname][iname]
    return {"pixel_values": pixel_values, "image_grid_thw": grid}


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("cname,iname", list(_cases()))
def test_matches_transformers(cname, iname, backend, request):
    """Bitwise equal to the transformers processor of the same backend, for every family."""
    config = CONFIGS[cname]
    data = CORPUS[iname]
    if backend == "pil":
        ref = reference_output(Qwen2VLImageProcessorPil.from_dict(config), reference_image(data))
    else:
        ref = _tv_output(request.getfixturevalue("tv_ref"), cname, iname)
    pp = load_preprocessor(config, MODEL_TYPES[cname], backend=backend)
    out = pp.preprocess(decode_image(data, LIMITS))
    _assert_matches(out, ref)
    header = probe_image(data, LIMITS)
    assert pp.predict(header.width, header.height) == (out.grid_thw, out.num_tokens)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_torchvision_variants_match_transformers(variant, tv_ref):
    """Other filters (transformers' PIL -> torchvision mapping) and normalization settings."""
    pp = load_preprocessor(VARIANTS[variant], "qwen2_vl", backend="torchvision")
    for iname in VARIANT_IMAGES:
        ref = _tv_output(tv_ref, variant, iname)
        _assert_matches(pp.preprocess(decode_image(CORPUS[iname], LIMITS)), ref)


def test_torchvision_override_equals_reference_with_same_bounds(tv_ref):
    pp = load_preprocessor(QWEN2_CONFIG, "qwen2_vl", backend="torchvision")
    for iname in VARIANT_IMAGES:
        out = pp.preprocess(decode_image(CORPUS[iname], LIMITS), max_pixels=200_000)
        _assert_matches(out, _tv_output(tv_ref, "override", iname))


def test_backends_differ_and_are_keyed_apart():
    """Why the setting exists: the two references disagree, so they must not share cache entries."""
    img = decode_image(CORPUS["png_rgb_517x333"], LIMITS)
    tv = load_preprocessor(QWEN2_CONFIG, "qwen2_vl")
    pil = load_preprocessor(QWEN2_CONFIG, "qwen2_vl", backend="pil")
    assert tv.params()["backend"] == "torchvision" and pil.params()["backend"] == "pil"
    assert tv.params() != pil.params() and tv.resolve(max_pixels=10**6) != pil.resolve(max_pixels=10**6)
    ident = {"model_id": "m", "revision": "r"}
    assert content_key(b"x", params=tv.resolve(), **ident) != content_key(b"x", params=pil.resolve(), **ident)
    a, b = tv.preprocess(img), pil.preprocess(img)
    assert a.grid_thw == b.grid_thw and not torch.equal(a.pixel_values, b.pixel_values)
    with pytest.raises(ConfigError):
        load_preprocessor(QWEN2_CONFIG, "qwen2_vl", backend="opencv")
    with pytest.raises(ConfigError):  # BOX has no torchvision counterpart
        load_preprocessor({**QWEN2_CONFIG, "resample": 4}, "qwen2_vl")
    assert load_preprocessor({**QWEN2_CONFIG, "resample": 4}, "qwen2_vl", backend="pil").params()["resample"] == 4


def test_auto_image_processor_checkpoint_dir(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_CONFIG))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    hf = AutoImageProcessor.from_pretrained(str(tmp_path))  # torchvision is not importable here: PIL
    assert type(hf) is Qwen2VLImageProcessorPil
    pp = load_preprocessor(tmp_path, backend="pil")
    assert isinstance(pp, ImagePreprocessor) and pp.patch_size == 16
    img = reference_image(CORPUS["jpeg_rgb_640x480"])
    _assert_matches(pp.preprocess(img), reference_output(hf, img))


def test_auto_image_processor_with_torchvision_is_our_default(tmp_path, tv_ref):
    """With torchvision importable, transformers picks the torchvision class: our default equals it."""
    assert tv_ref["classes"]["auto"] == "Qwen2VLImageProcessor"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_CONFIG))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    out = load_preprocessor(tmp_path).preprocess(decode_image(CORPUS["jpeg_rgb_640x480"], LIMITS))
    _assert_matches(out, _tv_output(tv_ref, "auto", "jpeg_rgb_640x480"))


def test_direct_pil_inputs_match():
    hf = Qwen2VLImageProcessorPil.from_dict(SMALL_MAX)
    pp = load_preprocessor(SMALL_MAX, "qwen2_5_vl", backend="pil")
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
    pp = load_preprocessor(QWEN2_CONFIG, "qwen2_vl", backend="pil")
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
