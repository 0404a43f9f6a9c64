# SPDX-License-Identifier: Apache-2.0
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from epd_encoder.engine.cost import item_cost
from epd_encoder.preprocess.registry import load_preprocessor
from tests.preprocess.conftest import QWEN2_CONFIG


def test_default_cost_is_pre_merge_patches():
    assert item_cost((1, 4, 4)) == 16
    assert item_cost((2, 3, 5)) == 30
    assert item_cost([1, 1, 1]) == 1


def test_cost_counts_the_patches_the_tower_runs_not_the_merged_tokens():
    # The real Qwen preprocessor: its grid and its rows are pre-merge patches, 4 per token.
    pp = load_preprocessor(QWEN2_CONFIG, "qwen2_vl")
    out = pp.preprocess(Image.new("RGB", (392, 280)))
    assert item_cost(out.grid_thw) == out.pixel_values.shape[0] == 4 * out.num_tokens


def test_attention_term_is_quadratic_per_frame():
    assert item_cost((1, 4, 4), attention_weight=1.0) == 16 + 16 * 16
    # Two frames are two windows: twice one frame's term, not (32)^2.
    assert item_cost((2, 4, 4), attention_weight=1.0) == 32 + 2 * 16 * 16


def test_attention_term_with_windows():
    # 16 patches in windows of 6: 6 + 6 + 4.
    assert item_cost((1, 4, 4), attention_weight=1.0, window_patches=6) == 16 + 36 + 36 + 16
    assert item_cost((1, 4, 4), attention_weight=1.0, window_patches=16) == item_cost(
        (1, 4, 4), attention_weight=1.0
    )


def test_attention_term_rounds_up_and_scales():
    assert item_cost((1, 4, 4), attention_weight=0.001) == 16 + 1  # ceil(0.256)
    assert item_cost((1, 4, 4), attention_weight=0.5) == 16 + 128


def test_weight_zero_ignores_windows():
    assert item_cost((3, 5, 7), window_patches=4) == 105


@pytest.mark.parametrize(
    "args,kwargs",
    [
        (((0, 4, 4),), {}),
        (((1, -1, 4),), {}),
        (((1, 4),), {}),
        (((1, 4, 4),), {"attention_weight": -1.0}),
        (((1, 4, 4),), {"attention_weight": float("nan")}),
        (((1, 4, 4),), {"attention_weight": 1.0, "window_patches": 0}),
    ],
)
def test_invalid_arguments_raise(args, kwargs):
    with pytest.raises(ValueError):
        item_cost(*args, **kwargs)


dim = st.integers(1, 64)


@settings(max_examples=100, deadline=None)
@given(dim, dim, dim, st.floats(0.0, 2.0), st.one_of(st.none(), st.integers(1, 5000)))
def test_cost_properties(t, h, w, weight, window):
    c = item_cost((t, h, w), attention_weight=weight, window_patches=window)
    assert isinstance(c, int)
    assert c >= t * h * w
    # Growing any dimension never makes an item cheaper.
    for bigger in ((t + 1, h, w), (t, h + 1, w), (t, h, w + 1)):
        assert item_cost(bigger, attention_weight=weight, window_patches=window) >= c
    # Windowed attention never costs more than full attention over the frame.
    assert c <= item_cost((t, h, w), attention_weight=weight)
