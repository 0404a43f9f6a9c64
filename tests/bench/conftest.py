# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

from epd_encoder.models.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "qwen2_5_vl")
