# SPDX-License-Identifier: Apache-2.0
import ast
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoImageProcessor

from epd_encoder.errors import ConfigError, UnsupportedModel
from epd_encoder.preprocess import base
from epd_encoder.preprocess.base import DecodeLimits, ImagePreprocessor
from epd_encoder.preprocess.decode import decode_image
from epd_encoder.preprocess.internvl import InternVLPreprocessor
from epd_encoder.preprocess.qwen import QwenPreprocessor
from epd_encoder.preprocess.registry import load_preprocessor, load_video_preprocessor, supported_model_types
from epd_encoder.preprocess.video import VideoBounds
from tests.models import hub_layouts

from .conftest import INTERNVL_CONFIG, QWEN2_CONFIG


def test_factory_reads_checkpoint_dirs(tmp_path):
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "preprocessor_config.json").write_text(json.dumps(QWEN2_CONFIG))
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    pp = load_preprocessor(qwen)
    assert isinstance(pp, QwenPreprocessor) and isinstance(pp, ImagePreprocessor)
    assert pp.params() == load_preprocessor(QWEN2_CONFIG, "qwen2_vl").params()

    internvl = tmp_path / "internvl"
    internvl.mkdir()
    (internvl / "processor_config.json").write_text(json.dumps({"image_processor": INTERNVL_CONFIG}))
    (internvl / "config.json").write_text(json.dumps({"model_type": "internvl", "vision_config": {"patch_size": 14}}))
    assert isinstance(load_preprocessor(internvl), InternVLPreprocessor)

    with pytest.raises(UnsupportedModel):
        load_preprocessor(qwen, "gemma3")
    with pytest.raises(ConfigError):
        load_preprocessor(tmp_path)  # no preprocessor config there
    with pytest.raises(ConfigError):
        load_preprocessor(tmp_path / "missing")
    (qwen / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError):
        load_preprocessor(qwen)


def test_every_model_type_has_a_builder():
    for model_type in supported_model_types():
        assert load_preprocessor(INTERNVL_CONFIG if model_type == "internvl" else QWEN2_CONFIG, model_type)
    with pytest.raises(ConfigError):
        load_preprocessor(INTERNVL_CONFIG, "internvl", pixel_bounds=(3136, 12845056))


def test_base_imports_no_family():
    # Families import base; base importing them back is the circle the registry removed.
    code = (
        "import sys\n"
        "import epd_encoder.preprocess.base\n"
        "families = [m for m in ('qwen', 'internvl', 'registry') if f'epd_encoder.preprocess.{m}' in sys.modules]\n"
        "assert not families, families\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_base_names_no_family_even_lazily():
    # A function-level import would close the circle again without showing in sys.modules.
    tree = ast.parse(open(base.__file__, encoding="utf-8").read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.split(".")[-1] in ("qwen", "internvl", "registry")}


HUB_SKIP = pytest.mark.skipif(hub_layouts.missing_reason() is not None, reason=str(hub_layouts.missing_reason()))


@HUB_SKIP
@pytest.mark.parametrize("family", sorted(hub_layouts.HUB_FILES))
def test_hub_layout_preprocesses_as_transformers_loads_it(family):
    """The directory as the family's Hub repository lays it out, files written by the processors'
    own save_pretrained: our image preprocessor equals what AutoImageProcessor loads from it."""
    pixel_values, grid, _ = hub_layouts.reference(family)
    out = load_preprocessor(hub_layouts.hub_checkpoint(family)).preprocess(
        decode_image(hub_layouts.image_bytes(), DecodeLimits()))
    assert torch.equal(out.pixel_values, pixel_values), f"max |diff| {(out.pixel_values - pixel_values).abs().max()}"
    assert list(out.grid_thw)[:grid.numel()] == grid.tolist()  # InternVL's grid is its tile count alone


@HUB_SKIP
@pytest.mark.parametrize("family", sorted(hub_layouts.VIDEO_FAMILIES))
def test_hub_layout_video_settings_are_what_transformers_loads(family):
    """Qwen2-VL and Qwen2.5-VL repositories have no video_preprocessor_config.json: transformers
    then takes preprocessor_config.json, and so must we; InternVL has no video path here."""
    _, _, hf = hub_layouts.reference(family)
    path = hub_layouts.hub_checkpoint(family)
    if family == "internvl":
        with pytest.raises(UnsupportedModel):
            load_video_preprocessor(path)
        return
    ours = load_video_preprocessor(path, bounds=VideoBounds(max_frames=768)).params()
    size = dict(hf["size"])
    if hf["class"] == "Qwen2VLVideoProcessor":  # its __init__ lets top-level min/max_pixels win
        size = {"shortest_edge": hf.get("min_pixels") or size["shortest_edge"],
                "longest_edge": hf.get("max_pixels") or size["longest_edge"]}
    expected = {"fps": float(hf.get("fps") or 2.0), "min_frames": hf["min_frames"], "max_frames": hf["max_frames"],
                "min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"],
                "patch_size": hf["patch_size"], "temporal_patch_size": hf["temporal_patch_size"],
                "merge_size": hf["merge_size"]}
    assert {k: ours[k] for k in expected} == expected


def test_nested_processor_config_wins_as_in_transformers(tmp_path):
    """transformers reads processor_config.json's image_processor before preprocessor_config.json
    (a v5 save beside a base model's copied preprocessor_config.json): so must we."""
    nested = {**QWEN2_CONFIG, "max_pixels": 200_704}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": nested}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN2_CONFIG))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    hf = AutoImageProcessor.from_pretrained(str(tmp_path))
    assert hf.size["longest_edge"] == 200_704  # the nested one, by transformers' own loader
    assert load_preprocessor(tmp_path).params() == load_preprocessor(nested, "qwen2_5_vl").params()
