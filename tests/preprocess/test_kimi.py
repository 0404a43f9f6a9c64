# SPDX-License-Identifier: Apache-2.0
"""Kimi K2.5 preprocessing equals transformers' Kimi_K25ImageProcessor (torchvision-only) bitwise."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from epd_encoder.errors import ConfigError, InvalidInput
from epd_encoder.models.tiny import image_processor_config
from epd_encoder.preprocess.base import DecodeLimits, ImagePreprocessor
from epd_encoder.preprocess.decode import decode_image, probe_image
from epd_encoder.preprocess.kimi import navit_resize
from epd_encoder.preprocess.registry import load_preprocessor

from . import tv_reference
from .conftest import CORPUS, rgb_array

# The class defaults (a real checkpoint's values), the tiny checkpoint's, and budgets that
# make the corpus images shrink: by total patches, and by patches per side.
REAL = {"image_processor_type": "Kimi_K25ImageProcessor"}
CONFIGS = {
    "real": REAL,
    "tiny": image_processor_config("kimi_k25"),
    "few_patches": {**REAL, "max_patches": 300},
    "short_side": {**REAL, "size": {"max_height": 20, "max_width": 20}},
    "bilinear_no_norm": {**REAL, "max_patches": 500, "resample": 2, "do_normalize": False},
}
LIMITS = DecodeLimits()
HEAVY = {"png_rgb_1500x900", "png_rgb_10x1900", "png_rgb_2000x12"}


def _cases():
    for cname in CONFIGS:
        for iname in sorted(CORPUS):
            if iname in HEAVY and cname not in ("real", "few_patches"):
                continue
            yield cname, iname


@pytest.fixture(scope="module")
def tv_ref():
    if reason := tv_reference.missing_reason():
        pytest.skip(reason)
    jobs = [{"name": c, "processor": "kimi_k25", "config": cfg, "images": [i for n, i in _cases() if n == c]}
            for c, cfg in CONFIGS.items()]
    auto = {"preprocessor": CONFIGS["tiny"], "model": {"model_type": "kimi_k25"}}
    jobs.append({"name": "auto", "processor": "auto", "config": auto, "images": ["jpeg_rgb_640x480"]})
    outputs, classes = tv_reference.run_reference(jobs, CORPUS)
    return outputs, classes


def _assert_equal(out, ref):
    pixel_values, grid = ref
    assert out.pixel_values.dtype == torch.float32 and out.pixel_values.shape[1:] == (3, 14, 14)
    assert torch.equal(out.pixel_values, pixel_values), f"max |diff| {(out.pixel_values - pixel_values).abs().max()}"
    assert list(out.grid_thw) == grid.reshape(-1, 3)[0].tolist()
    assert out.num_tokens == out.num_patches // 4


@pytest.mark.parametrize("cname,iname", list(_cases()))
def test_matches_transformers(cname, iname, tv_ref):
    outputs, _ = tv_ref
    pp = load_preprocessor(CONFIGS[cname], "kimi_k25")
    out = pp.preprocess(decode_image(CORPUS[iname], LIMITS))
    _assert_equal(out, outputs[cname][iname])
    header = probe_image(CORPUS[iname], LIMITS)
    assert pp.predict(header.width, header.height) == (out.grid_thw, out.num_tokens)


def test_resize_paths_are_exercised():
    """The budgets above really shrink (not only pad) the corpus images."""
    shrunk = {c for c, i in _cases() if c != "real" and navit_resize(
        *probe_size(i), 14, 2, CONFIGS[c].get("max_patches", 16384),
        CONFIGS[c].get("size", {}).get("max_height", 512))[0] != probe_size(i)}
    assert shrunk == {"tiny", "few_patches", "short_side", "bilinear_no_norm"}


def probe_size(iname):
    h = probe_image(CORPUS[iname], LIMITS)
    return h.height, h.width


def test_auto_image_processor_checkpoint_dir(tmp_path, tv_ref):
    outputs, classes = tv_ref
    assert classes["auto"] == "Kimi_K25ImageProcessor"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(CONFIGS["tiny"]))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25"}))
    pp = load_preprocessor(tmp_path)
    assert isinstance(pp, ImagePreprocessor) and pp.family == "kimi_k25"
    _assert_equal(pp.preprocess(decode_image(CORPUS["jpeg_rgb_640x480"], LIMITS)),
                  outputs["auto"]["jpeg_rgb_640x480"])


def _hf_navit_resize():
    """transformers' own ``navit_resize``, taken from its source: the module imports torchvision."""
    path = Path(transformers.__file__).parent / "models" / "kimi_k25" / "image_processing_kimi_k25.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    scope = {"math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)
    return scope["navit_resize"]


@given(h=st.integers(1, 9000), w=st.integers(1, 9000), patches=st.integers(4, 20000), side=st.integers(2, 600))
@settings(max_examples=400, deadline=None)
def test_navit_resize_arithmetic(h, w, patches, side):
    hf = _hf_navit_resize()
    want = hf(h, w, patch_size=14, merge_kernel_size=2, max_patches=patches, max_size_per_side=side)
    got = navit_resize(h, w, 14, 2, patches, side)
    assert got == want
    (rh, rw), (ph, pw) = got
    assert rh <= h and rw <= w and ph % 28 == 0 and pw % 28 == 0


def test_pil_backend_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match="torchvision-only"):
        load_preprocessor(REAL, "kimi_k25", backend="pil")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(REAL))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25"}))
    with pytest.raises(ConfigError, match="--preprocess-backend 'pil'"):
        load_preprocessor(tmp_path, backend="pil")


def test_overrides_and_bounds_are_refused():
    pp = load_preprocessor(REAL, "kimi_k25")
    assert pp.resolve() == pp.params()
    with pytest.raises(InvalidInput):
        pp.resolve(max_pixels=100_000)
    with pytest.raises(InvalidInput):
        pp.preprocess(Image.fromarray(rgb_array(30, 30)), min_pixels=10)
    with pytest.raises(ConfigError):
        load_preprocessor(REAL, "kimi_k25", pixel_bounds=(1, 10))
    with pytest.raises(ConfigError):
        load_preprocessor({**REAL, "size": {"max_height": 512, "max_width": 256}}, "kimi_k25")


def test_padding_is_normalized_zero_and_layout_is_raster():
    pp = load_preprocessor(REAL, "kimi_k25")
    img = Image.fromarray(rgb_array(30, 15))  # padded to 56 x 28: 2 x 4 patches
    staged = pp.stage(img)
    assert staged.grid_thw == (1, 2, 4) and staged.num_tokens == 2
    canvas = staged.pixels.view(2, 4, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(28, 56, 3)
    assert torch.equal(canvas[:15, :30], torch.from_numpy(rgb_array(30, 15)))
    assert not canvas[15:].any() and not canvas[:, 30:].any()
    out = pp.finish(staged)
    assert (out.pixel_values.view(2, 4, 3, 14, 14)[1, :, :, 1:] == -1.0).all()  # (0 - 0.5) / 0.5
    dev = pp.finish(staged, device="cpu")
    assert torch.equal(dev.pixel_values, out.pixel_values)


def test_params_distinguish_pixels():
    seen = [load_preprocessor(REAL, "kimi_k25").params()]
    json.dumps(seen[0])
    for change in ({"max_patches": 1000}, {"size": {"max_height": 64, "max_width": 64}}, {"resample": 2},
                   {"patch_size": 16}, {"merge_size": 1}, {"image_mean": [0.4, 0.5, 0.5]}, {"do_rescale": False}):
        p = load_preprocessor({**REAL, **change}, "kimi_k25").params()
        assert all(p != q for q in seen), change
        seen.append(p)
