# SPDX-License-Identifier: Apache-2.0
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
    GotOcr2ImageProcessorPil,
    get_optimal_tiled_canvas,
)

from epd_encoder.errors import ConfigError, InvalidInput
from epd_encoder.preprocess.base import DecodeLimits, PixelNormalizer, StagedImage
from epd_encoder.preprocess.decode import decode_image, probe_image
from epd_encoder.preprocess.internvl import InternVLPreprocessor, exact_arithmetic, tile_grid
from epd_encoder.preprocess.registry import load_preprocessor

from . import tv_reference
from .conftest import CORPUS, INTERNVL_CONFIG, reference_image, reference_output, rgb_array

MODEL_CONFIG = {"model_type": "internvl", "downsample_ratio": 0.5, "vision_config": {"patch_size": [14, 14]}}
CONFIGS = {
    "internvl3": INTERNVL_CONFIG,
    "few_tiles": {**INTERNVL_CONFIG, "min_patches": 2, "max_patches": 6, "size": {"height": 224, "width": 224}},
    "no_tiling": {**INTERNVL_CONFIG, "crop_to_patches": False},
}
LIMITS = DecodeLimits()
IMAGES = ["png_rgb_28x28", "png_rgb_13x7", "png_rgb_517x333", "png_rgb_1500x900", "png_rgb_2000x12", "png_rgb_10x1900",
          "jpeg_exif_6", "jpeg_cmyk", "png_rgba", "png_p_transparent", "png_i16", "gif", "webp_rgba", "bmp_p"]


def _reference(config, data):
    out = reference_output(GotOcr2ImageProcessorPil.from_dict(config), reference_image(data))
    return torch.from_numpy(out["pixel_values"]), int(out["num_patches"][0])


# The largest image runs once: it is slow under the reference.
CASES = [(c, i) for c in sorted(CONFIGS) for i in IMAGES if i != "png_rgb_1500x900" or c == "internvl3"]
# Filters no checkpoint above uses, torchvision backend only (transformers' PIL -> torchvision mapping).
VARIANTS = {f"resample_{r}": {**CONFIGS["few_tiles"], "resample": r} for r in (0, 1, 2)}
VARIANT_IMAGES = ["png_rgb_13x7", "png_rgb_517x333", "png_rgb_2000x12", "png_rgba"]


@pytest.fixture(scope="module")
def tv_ref():
    """Outputs of transformers' torchvision-backend GotOcr2ImageProcessor, from one child process."""
    if reason := tv_reference.missing_reason():
        pytest.skip(reason)
    jobs = [{"name": c, "processor": "got_ocr2", "config": CONFIGS[c], "images": [i for n, i in CASES if n == c]}
            for c in CONFIGS]
    jobs += [{"name": v, "processor": "got_ocr2", "config": cfg, "images": VARIANT_IMAGES}
             for v, cfg in VARIANTS.items()]
    auto = {"preprocessor": INTERNVL_CONFIG, "model": MODEL_CONFIG}
    jobs.append({"name": "auto", "processor": "auto", "config": auto, "images": ["jpeg_rgb_640x480"]})
    outputs, classes = tv_reference.run_reference(jobs, CORPUS)
    return {**outputs, "classes": classes}


def _assert_tiles_equal(out, ref, tiles):
    # Per-tile comparison checks the tile count, the order and the values at once.
    assert out.pixel_values.shape == ref.shape and out.pixel_values.shape[0] == tiles
    assert out.pixel_values.dtype == torch.float32
    for i in range(tiles):
        assert torch.equal(out.pixel_values[i], ref[i]), f"tile {i}: {(out.pixel_values[i] - ref[i]).abs().max()}"


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("cname,iname", CASES)
def test_matches_transformers(cname, iname, backend, request):
    """Bitwise equal to the transformers processor of the same backend."""
    config, data = CONFIGS[cname], CORPUS[iname]
    if backend == "pil":
        ref, tiles = _reference(config, data)
    else:
        ref, num_patches = request.getfixturevalue("tv_ref")[cname][iname]
        tiles = int(num_patches[0])
    pp = load_preprocessor(config, model_config=MODEL_CONFIG, backend=backend)
    out = pp.preprocess(decode_image(data, LIMITS))
    _assert_tiles_equal(out, ref, tiles)
    side = config["size"]["height"] // 14
    assert out.grid_thw == (tiles, side, side)
    assert out.num_tokens == tiles * (side // 2) ** 2
    header = probe_image(data, LIMITS)
    assert pp.predict(header.width, header.height) == (out.grid_thw, out.num_tokens)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_torchvision_variants_match_transformers(variant, tv_ref):
    pp = load_preprocessor(VARIANTS[variant], model_config=MODEL_CONFIG, backend="torchvision")
    for iname in VARIANT_IMAGES:
        ref, num_patches = tv_ref[variant][iname]
        _assert_tiles_equal(pp.preprocess(decode_image(CORPUS[iname], LIMITS)), ref, int(num_patches[0]))


def test_auto_image_processor_with_torchvision_is_our_default(tmp_path, tv_ref):
    assert tv_ref["classes"]["auto"] == "GotOcr2ImageProcessor"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(INTERNVL_CONFIG))
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    ref, num_patches = tv_ref["auto"]["jpeg_rgb_640x480"]
    out = load_preprocessor(tmp_path).preprocess(decode_image(CORPUS["jpeg_rgb_640x480"], LIMITS))
    _assert_tiles_equal(out, ref, int(num_patches[0]))


def test_thumbnail_is_last_and_tiles_are_row_major():
    pp = load_preprocessor(INTERNVL_CONFIG, model_config=MODEL_CONFIG, backend="pil")
    img = Image.fromarray(rgb_array(900, 448, 3))  # 2 columns x 1 row + thumbnail
    staged = pp.stage(img)
    assert staged.pixels.shape == (3, 3, 448, 448)
    canvas = np.asarray(img.resize((896, 448), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
    assert np.array_equal(staged.pixels[0].numpy(), canvas[:, :, :448])
    assert np.array_equal(staged.pixels[1].numpy(), canvas[:, :, 448:])
    thumb = np.asarray(img.resize((448, 448), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
    assert np.array_equal(staged.pixels[2].numpy(), thumb)


def test_auto_image_processor_checkpoint_dir(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(INTERNVL_CONFIG))
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    hf = AutoImageProcessor.from_pretrained(str(tmp_path))  # torchvision is not importable here: PIL
    assert type(hf) is GotOcr2ImageProcessorPil
    pp = load_preprocessor(tmp_path, backend="pil")
    assert isinstance(pp, InternVLPreprocessor)
    img = reference_image(CORPUS["jpeg_rgb_640x480"])
    ref = torch.from_numpy(reference_output(hf, img)["pixel_values"])
    assert torch.equal(pp.preprocess(img).pixel_values, ref)


def test_device_path_equals_numpy_path():
    pp = load_preprocessor(CONFIGS["few_tiles"], "internvl")
    staged = pp.stage(decode_image(CORPUS["png_rgb_517x333"], LIMITS))
    assert staged.pixels.dtype == torch.uint8
    assert torch.equal(pp.finish(staged).pixel_values, pp.finish(staged, device="cpu").pixel_values)


@pytest.mark.parametrize("factor,found", [(1 / 255, True), (1 / 127.5, True), (0.0039, False), (None, True)])
@pytest.mark.parametrize("mean", [(0.485, 0.456, 0.406), (0.5, 0.5, 0.5), None])
def test_pil_arithmetic_is_bitwise_the_table_or_absent(factor, found, mean):
    norm = PixelNormalizer(do_rescale=factor is not None, rescale_factor=factor or 1.0, do_normalize=mean is not None,
                           image_mean=mean or (0.5,) * 3, image_std=(0.229, 0.224, 0.225), backend="pil")
    exact = exact_arithmetic(norm)
    assert (exact is not None) == found
    pp = InternVLPreprocessor(normalizer=norm, backend="pil")
    tiles = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 3, 56, 56), dtype=np.uint8))
    want = torch.from_numpy(norm.apply_numpy(tiles.numpy()))
    got = pp.finish(StagedImage(tiles, (3, 4, 4), 12)).pixel_values
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@given(
    h=st.integers(1, 5000),
    w=st.integers(1, 5000),
    tile=st.sampled_from([224, 448]),
    lo=st.integers(1, 4),
    hi=st.integers(1, 16),
)
@settings(max_examples=300, deadline=None)
def test_tile_grid_matches_reference(h, w, tile, lo, hi):
    assert tile_grid(h, w, tile, tile, lo, hi) == get_optimal_tiled_canvas((h, w), (tile, tile), lo, hi)


def test_model_config_sets_grid_and_tokens():
    cfg = {"downsample_ratio": 0.25, "vision_config": {"patch_size": 16}}
    pp = load_preprocessor({**INTERNVL_CONFIG, "size": {"height": 256, "width": 256}}, "internvl", model_config=cfg)
    grid, tokens = pp.predict(256, 256)
    assert grid == (1, 16, 16) and tokens == 16
    with pytest.raises(ConfigError):
        load_preprocessor(INTERNVL_CONFIG, "internvl", model_config={"downsample_ratio": 0.3})


def test_overrides_rejected_and_params_distinguish():
    pp = load_preprocessor(INTERNVL_CONFIG, "internvl")
    with pytest.raises(InvalidInput):
        pp.resolve(max_pixels=1000)
    with pytest.raises(InvalidInput):
        pp.preprocess(Image.fromarray(rgb_array(30, 30)), min_pixels=10)
    assert pp.resolve() == pp.params()
    json.dumps(pp.params())
    seen = [pp.params()]
    for change in ({"max_patches": 6}, {"min_patches": 2}, {"crop_to_patches": False},
                   {"size": {"height": 224, "width": 224}}, {"image_mean": [0.5, 0.5, 0.5]}, {"resample": 2}):
        p = load_preprocessor({**INTERNVL_CONFIG, **change}, "internvl").params()
        assert all(p != q for q in seen), change
        seen.append(p)
    pil = load_preprocessor(INTERNVL_CONFIG, "internvl", backend="pil").params()
    assert pil["backend"] == "pil" and pp.params()["backend"] == "torchvision" and all(pil != q for q in seen)
    with pytest.raises(ConfigError):
        load_preprocessor({**INTERNVL_CONFIG, "size": {"shortest_edge": 448}}, "internvl")
