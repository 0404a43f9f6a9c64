# SPDX-License-Identifier: Apache-2.0
"""make-tiny-model --vllm-compatible (LM head size 64, which vLLM's CPU attention runs) and the
chat templates every tiny Qwen checkpoint carries (vLLM's chat API refuses a model without one).
The engine itself runs these checkpoints in tests/integrations/test_vllm_embeds.py."""

from __future__ import annotations

import json

import pytest
import torch

from epd_encoder.models.tiny import default_model_dir, make_tiny_model_main, tiny_config, write_tiny_model
from epd_encoder.models.tiny_configs import VLLM_FAMILIES

# vLLM 0.32's CPUAttentionBackend.get_supported_head_sizes() (v1/attention/backends/cpu_attn.py).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_vllm_compatible_lm_has_a_head_size_vllm_cpu_runs(family):
    default, vllm = tiny_config(family).text_config, tiny_config(family, vllm_compatible=True).text_config
    assert _head_dim(default) not in VLLM_CPU_HEAD_SIZES  # why the flag exists
    assert _head_dim(vllm) == 64
    rope = vllm.rope_parameters
    rotary = int(_head_dim(vllm) * rope.get("partial_rotary_factor", 1.0))
    assert sum(rope["mrope_section"]) == rotary // 2
    assert tiny_config(family, vllm_compatible=True).vision_config.depth == tiny_config(family).vision_config.depth
    if family.startswith("qwen3_5"):  # vLLM's CPU chunk_gated_delta_rule refuses 16 and 32
        assert vllm.linear_key_head_dim == vllm.linear_value_head_dim == 128


def test_vllm_compatible_is_refused_for_other_families(tmp_path):
    with pytest.raises(ValueError, match="vllm_compatible"):
        tiny_config("internvl", vllm_compatible=True)
    with pytest.raises(SystemExit):
        make_tiny_model_main([str(tmp_path / "x"), "--family", "kimi_k25", "--vllm-compatible"])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_vllm_compatible_checkpoint_loads_and_runs_in_transformers(family, tmp_path):
    from transformers import AutoModelForImageTextToText

    d = write_tiny_model(family, tmp_path / family, vllm_compatible=True)
    model, info = AutoModelForImageTextToText.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()), info
    assert _head_dim(model.config.text_config) == 64
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_chat_template_is_carried_as_real_checkpoints_carry_it(family, tmp_path):
    from transformers import AutoTokenizer

    d = write_tiny_model(family, tmp_path / family)
    template = json.loads((d / "chat_template.json").read_text())["chat_template"]
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == template
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                             {"type": "text", "text": "Describe."}]}]
    text = AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>Describe." in text
    assert text.endswith("<|im_start|>assistant\n")


def test_default_model_dir_keeps_the_vllm_variant_apart(tmp_path):
    a = default_model_dir("qwen2_vl", cache_dir=tmp_path)
    b = default_model_dir("qwen2_vl", cache_dir=tmp_path, vllm_compatible=True)
    assert a != b and b.name.endswith("-vllm")
    assert json.loads((b / "config.json").read_text())["text_config"]["hidden_size"] == 128


def test_cli_vllm_compatible_flag(tmp_path, capsys):
    out = tmp_path / "cli"
    assert make_tiny_model_main([str(out), "--family", "qwen3_vl", "--vllm-compatible"]) == 0
    assert json.loads((out / "config.json").read_text())["text_config"]["head_dim"] == 64
