# SPDX-License-Identifier: Apache-2.0
import ast
import json
import subprocess
import sys

import pytest

from epd_encoder.errors import ConfigError, UnsupportedModel
from epd_encoder.preprocess import base
from epd_encoder.preprocess.base import ImagePreprocessor
from epd_encoder.preprocess.internvl import InternVLPreprocessor
from epd_encoder.preprocess.qwen import QwenPreprocessor
from epd_encoder.preprocess.registry import load_preprocessor, supported_model_types

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
