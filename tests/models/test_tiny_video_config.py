# SPDX-License-Identifier: Apache-2.0
"""The tiny Qwen checkpoints carry the video processor config a real checkpoint has."""

from __future__ import annotations

import inspect
import json
import re

import pytest

from epd_encoder.models.tiny import image_processor_config, write_tiny_model
from epd_encoder.models.tiny_configs import MAX_FRAMES, QWEN_FAMILIES, video_processor_config


def _auto_video_class(model_type: str) -> str:
    """The class transformers' AutoVideoProcessor maps ``model_type`` to, read from its source:
    without torchvision the mapping itself holds None."""
    import transformers.models.auto.auto_mappings as a
    import transformers.models.auto.video_processing_auto as v

    pattern = rf'\("{model_type}", \{{"torchvision": "(\w+)"\}}\)'
    for module in (v, a):
        found = re.search(pattern, inspect.getsource(module))
        if found:
            return found.group(1)
    raise AssertionError(f"no video processor mapped for {model_type}")


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_video_config_is_the_family_class_with_small_bounds(family):
    video = video_processor_config(family)
    assert video["video_processor_type"] == _auto_video_class(family)
    image = image_processor_config(family)
    for key in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "resample"):
        assert video[key] == image[key], key
    assert video["size"]["longest_edge"] <= 448 * 448 and video["max_frames"] == MAX_FRAMES
    assert video["min_frames"] <= video["max_frames"]


def test_written_next_to_the_image_config_and_not_for_other_families(tmp_path):
    d = write_tiny_model("qwen2_5_vl", tmp_path / "q")
    assert json.loads((d / "video_preprocessor_config.json").read_text()) == json.loads(
        json.dumps(video_processor_config("qwen2_5_vl")))
    assert video_processor_config("internvl") is None and video_processor_config("kimi_k25") is None
