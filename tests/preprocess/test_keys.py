# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st

from epd_encoder import content_key
from epd_encoder.preprocess.keys import KEY_BYTES, KeyContext, canonical_params

BASE = dict(model_id="Qwen/Qwen2.5-VL-7B-Instruct", revision="abc123",
            params={"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14})


def test_key_is_256_bit_and_deterministic():
    k = content_key(b"\x89PNG...", **BASE)
    assert len(k) == KEY_BYTES == 32
    assert k == content_key(bytearray(b"\x89PNG..."), **BASE)
    assert k == content_key(memoryview(b"\x89PNG..."), **BASE)


@pytest.mark.parametrize("change", [
    {"model_id": "Qwen/Qwen2-VL-7B-Instruct"},
    {"revision": "def456"},
    {"params": {"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14}},
    {"modality": "video"},
])
def test_every_field_is_in_the_key(change):
    assert content_key(b"img", **{**BASE, **change}) != content_key(b"img", **BASE)


def test_param_order_does_not_matter_but_values_do():
    a = content_key(b"img", **{**BASE, "params": {"a": 1, "b": [1, 2]}})
    b = content_key(b"img", **{**BASE, "params": {"b": [1, 2], "a": 1}})
    c = content_key(b"img", **{**BASE, "params": {"b": [2, 1], "a": 1}})
    assert a == b != c


def test_framing_prevents_field_boundary_collisions():
    a = content_key(b"x", model_id="ab", revision="c", params={})
    b = content_key(b"x", model_id="a", revision="bc", params={})
    assert a != b


def test_non_canonical_params_are_refused():
    with pytest.raises(ValueError):
        canonical_params({"x": float("nan")})
    with pytest.raises(TypeError):
        canonical_params({"x": object()})


def test_threaded_and_single_paths_agree_with_an_independent_computation():
    ctx = KeyContext(**BASE)
    big = bytes(range(256)) * (1 << 13)  # 2 MiB: the threaded path
    for data in (b"", b"small", big):
        framed = len(data).to_bytes(8, "little") + data
        expected = blake3(ctx._prefix + framed).digest()
        assert ctx.key(data) == expected


@given(st.binary(max_size=512), st.binary(max_size=512))
def test_distinct_bytes_get_distinct_keys(a, b):
    ctx = KeyContext(**BASE)
    assert (ctx.key(a) == ctx.key(b)) == (a == b)
