# SPDX-License-Identifier: Apache-2.0
"""Building blocks of the Qwen towers: in-place activations, rotary, scratch buffers, linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epd_encoder.models.towers.qwen_attention import Scratch, apply_rope, rope_inv_freq, rope_table
from epd_encoder.models.towers.qwen_vision import _ACTIVATIONS, activation, activation_, linear


@pytest.mark.parametrize("name", sorted(_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_activation_is_bitwise_the_function(name, dtype):
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(0)).to(dtype) * 4
    want = activation(name)(x)
    y = x.clone()
    got = activation_(name)(y)
    assert got.data_ptr() == y.data_ptr()
    assert torch.equal(got, want)


def _reference_rope(qkv, cos, sin):
    # transformers' form: full tables (the half repeated), rotate_half, fp32, cast back
    cos, sin = torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]
    out = []
    for t in (qkv[:, 0], qkv[:, 1]):
        t = t.float()
        x1, x2 = t.chunk(2, dim=-1)
        out.append((t * cos + torch.cat([-x2, x1], -1) * sin).to(qkv.dtype))
    return torch.stack(out, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_rotate_half_with_and_without_scratch(dtype):
    cos, sin = rope_table((2, 4, 6), 2, rope_inv_freq(16, 10000.0))
    assert cos.shape == (48, 8)
    qkv = torch.randn(48, 3, 2, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    plain = apply_rope(qkv, cos, sin)
    scratch = Scratch()
    scratched = apply_rope(qkv, cos, sin, scratch)
    assert plain.dtype == dtype and plain.shape == (48, 2, 2, 16)
    assert torch.equal(plain, scratched)
    torch.testing.assert_close(plain, _reference_rope(qkv, cos, sin), rtol=0, atol=1e-6 if dtype == torch.float32
                               else 1e-2)


def test_scratch_reuses_a_name_and_grows_on_demand():
    s, cpu = Scratch(), torch.device("cpu")
    a = s.take("x", (4, 8), torch.float32, cpu)
    assert s.take("x", (4, 8), torch.float32, cpu).data_ptr() == a.data_ptr()
    assert s.take("x", (2, 3), torch.float32, cpu).data_ptr() == a.data_ptr()  # the front of it
    assert s.take("y", (4, 8), torch.float32, cpu).data_ptr() != a.data_ptr()
    grown = s.take("x", (5, 8), torch.float32, cpu)
    assert grown.shape == (5, 8) and grown.data_ptr() != a.data_ptr()
    assert s.take("x", (5, 8), torch.bfloat16, cpu).dtype == torch.bfloat16


class _Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("bias", [True, False])
def test_linear_into_scratch_is_bitwise_the_module_and_subclasses_run_their_forward(bias):
    torch.manual_seed(0)
    lin, x, s = nn.Linear(24, 40, bias=bias), torch.randn(30, 24), Scratch()
    with torch.inference_mode():
        got = linear(x, lin, s, "out")
        assert got.data_ptr() == s.take("out", (30, 40), x.dtype, x.device).data_ptr()
        assert torch.equal(got, lin(x))
        doubled = _Doubled(24, 40, bias=bias)
        doubled.load_state_dict(lin.state_dict())
        assert torch.equal(linear(x, doubled, s, "out"), lin(x) * 2)


def test_block_with_scratch_runs_the_mlp_in_row_steps_and_agrees_with_one_step():
    from dataclasses import replace

    from epd_encoder.models.towers.qwen2_5_vl import GatedMlp
    from epd_encoder.models.towers.qwen_attention import plan_segments
    from epd_encoder.models.towers.qwen_vision import RMSNorm, VisionAttention, VisionBlock, mlp_rows

    torch.manual_seed(0)
    dim, hidden, n = 64, 4096, 300
    assert mlp_rows(hidden, 4) < n  # several MLP steps
    block = VisionBlock(RMSNorm(dim), RMSNorm(dim), VisionAttention(dim, 4), GatedMlp(dim, hidden, "silu")).eval()
    cos, sin = rope_table((1, 10, 30), 2, rope_inv_freq(16, 10000.0))
    plan = plan_segments([n], torch.device("cpu"))
    x = torch.randn(n, dim)
    with torch.inference_mode():
        want = block(x.clone(), cos, sin, plan)
        got = block(x.clone(), cos, sin, replace(plan, scratch=Scratch()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
