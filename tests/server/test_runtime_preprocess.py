# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

from dataclasses import replace

import pytest

from epd_encoder.config import ServeConfig
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.preprocess.registry import load_preprocessor
from epd_encoder.server.runtime import Runtime
from tests.e2e.harness import serve_config


def test_default_backend_is_torchvision_everywhere():
    # The server and load_preprocessor must agree: tests build aggregated inputs with the latter.
    assert ServeConfig().model.preprocess_backend == "torchvision"
    assert load_preprocessor({}, "qwen2_vl").params()["backend"] == "torchvision"


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize("bounded", [False, True])
def test_preprocess_backend_reaches_the_preprocessor(tmp_path, backend, bounded):
    config = serve_config(write_tiny_model("qwen2_vl", tmp_path / "m"))
    config = replace(config, model=replace(config.model, preprocess_backend=backend))
    if bounded:  # the pixel-bounds path loads the preprocessor twice
        config = replace(config, limits=replace(config.limits, max_pixels_ceiling=10**7))
    params = Runtime(config).preprocessor.params()
    assert params["backend"] == backend
    assert params == load_preprocessor(tmp_path / "m", backend=backend).params()
