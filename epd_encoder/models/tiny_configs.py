# SPDX-License-Identifier: Apache-2.0
"""The per-family configs of the tiny checkpoints (``models/tiny.py`` writes them).

Everything here is data: the transformers model config, the processor JSON files and
the tokenizer's special tokens of each tiny family. Sizes are tiny; what a family's
code paths depend on (patch and merge sizes, normalization, deepstack, windows,
linear-attention layers, MoE, MLA) is kept real.
"""

from __future__ import annotations

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "internvl", "kimi_k25")
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")

# What save_pretrained writes for the vision part (tower + merger/projector).
# Kimi K2.5: transformers 5.24 reverts its load-time renames on save, so the files keep
# the original MoonViT layout (``vision_tower.encoder.blocks.N.wqkv``, ``mm_projector.proj.0``);
# two names come back with a stray prefix (``vision_tower.encoder.patch_embed.proj``,
# ``model.mm_projector.pre_norm``), which models/towers/kimi_k25.py maps as well.
CHECKPOINT_VISION_PREFIXES: dict[str, tuple[str, ...]] = {
    "qwen2_vl": ("visual.",),
    "qwen2_5_vl": ("visual.",),
    "qwen3_vl": ("model.visual.",),
    "qwen3_5": ("model.visual.",),
    "qwen3_5_moe": ("model.visual.",),
    "internvl": ("vision_tower.", "multi_modal_projector."),
    "kimi_k25": ("vision_tower.", "mm_projector.", "model.mm_projector."),
}

VOCAB_SIZE = 320  # 256 byte-level symbols, the special tokens, then headroom
TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=4096,
    bos_token_id=256,
    eos_token_id=258,
    pad_token_id=256,
)
# --vllm-compatible: vLLM's CPU attention takes head sizes 32, 64, 80, ... only (not 24), so the
# LM gets head_dim 64 (hidden 128); mrope sections are rescaled to sum to the rotary half.
VLLM_TEXT = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)
VLLM_HEAD_DIM = 64
VLLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # ids 256.. in this order
INTERNVL_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>",
)
# Kimi's chat template writes <|media_begin|>image<|media_content|><|media_pad|><|media_end|>.
KIMI_SPECIALS = (
    "[BOS]", "<|im_user|>", "[EOS]", "<|media_begin|>", "<|media_end|>", "<|media_content|>",
    "<|media_pad|>", "<|kimi_k25_video_placeholder|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
)
QWEN_TOKEN_IDS = dict(vision_start_token_id=259, vision_end_token_id=260, image_token_id=262, video_token_id=263)
KIMI_TOKEN_IDS = dict(vision_start_token_id=259, vision_end_token_id=260, image_token_id=262, video_token_id=263)
# Small pixel bounds keep tests fast; the factor (patch * merge) stays the real one.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 448 * 448
MAX_FRAMES = 16
INTERNVL_MAX_TILES = 6
KIMI_MAX_PATCHES = 1024  # 448x448 px at patch 14 (the real budget is 16384)
IMAGENET_STANDARD = [0.5, 0.5, 0.5]
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _qwen3_5_text(text: dict, moe: bool, lm_scale: int | None, vllm: bool = False) -> dict:
    # Hybrid: one Gated-DeltaNet (linear attention) layer, then one full-attention layer.
    # head_dim 24 with the real partial_rotary_factor 0.25: 6 rotary dims, mrope 1+1+1
    # (--vllm-compatible: head_dim 64, 16 rotary dims, mrope 3+3+2; linear heads 128, the real
    # size: vLLM's CPU chunk_gated_delta_rule refuses 16 and 32, "Unexpected head dim size").
    linear = 128 if vllm else 16
    out = dict(
        text, num_hidden_layers=2, head_dim=VLLM_HEAD_DIM if vllm else 24,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=linear, linear_value_head_dim=linear, linear_num_key_heads=2, linear_num_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [3, 3, 2] if vllm else [1, 1, 1],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.25},
    )
    if moe:
        width = out.pop("intermediate_size") // 3 * (lm_scale or 1)
        out.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=width,
                   shared_expert_intermediate_size=width)
    return out


def _kimi_text(text: dict, lm_scale: int | None) -> dict:
    # DeepSeek-V3: MLA attention; layer 0 dense, layer 1 MoE (4 routed experts, 1 shared).
    return dict(
        text, model_type="deepseek_v3", num_hidden_layers=2, num_key_value_heads=2,
        moe_intermediate_size=32 * (lm_scale or 1), n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_mtp_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def tiny_config(family: str, *, lm_scale: int | None = None, vllm_compatible: bool = False):
    """The transformers config object of the tiny ``family`` model.

    ``lm_scale`` multiplies the language model's MLP width only (the vision part
    is unchanged): about ``lm_scale * 54 KiB`` of fp32 LM weights.
    ``vllm_compatible`` gives the LM dimensions vLLM's CPU backend runs (head_dim 64,
    hidden 128; the tower is unchanged but for its output width): Qwen families only.
    """
    from transformers import (
        InternVLConfig,
        Qwen2_5_VLConfig,
        Qwen2VLConfig,
        Qwen3_5Config,
        Qwen3_5MoeConfig,
        Qwen3VLConfig,
    )

    text = dict(TEXT)
    if vllm_compatible:
        if family not in VLLM_FAMILIES:
            raise ValueError(f"vllm_compatible is for {', '.join(VLLM_FAMILIES)}, not {family!r}")
        text.update(VLLM_TEXT)
    if lm_scale is not None:
        if lm_scale < 1:
            raise ValueError(f"lm_scale must be >= 1, got {lm_scale}")
        text["intermediate_size"] *= int(lm_scale)
    # mrope sections sum to head_dim / 2: 12 for the tiny head 24, 32 for vLLM's 64.
    rope = {"rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": [12, 10, 10] if vllm_compatible else [4, 4, 4]}
    out = text["hidden_size"]
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=out)
        return Qwen2VLConfig(text_config=dict(text, rope_parameters=rope), vision_config=vision, **QWEN_TOKEN_IDS)
    if family == "qwen2_5_vl":
        # window 112 px = 4 merged units: a 448 px image has 4x4 windows.
        vision = dict(
            depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=out,
            window_size=112, fullatt_block_indexes=[1, 3],
        )
        return Qwen2_5_VLConfig(text_config=dict(text, rope_parameters=rope), vision_config=vision, **QWEN_TOKEN_IDS)
    if family == "qwen3_vl":
        vision = dict(
            depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=out,
            num_position_embeddings=256, deepstack_visual_indexes=[0, 2],
        )
        rope3 = dict(rope, mrope_interleaved=True)
        return Qwen3VLConfig(
            text_config=dict(text, head_dim=VLLM_HEAD_DIM if vllm_compatible else 24, rope_parameters=rope3),
            vision_config=vision, **QWEN_TOKEN_IDS
        )
    if family in ("qwen3_5", "qwen3_5_moe"):
        # The Qwen3-VL tower without deepstack (patch 16, learned 16x16 position grid).
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=out,
                      num_position_embeddings=256)
        moe = family == "qwen3_5_moe"
        cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
        base = dict(TEXT, **(VLLM_TEXT if vllm_compatible else {})) if moe else text  # MoE: widens experts
        return cls(text_config=_qwen3_5_text(base, moe, lm_scale, vllm_compatible), vision_config=vision,
                   **QWEN_TOKEN_IDS)
    if family == "internvl":
        vision = dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            image_size=448, patch_size=14,
        )
        return InternVLConfig(text_config=dict(text, model_type="qwen2"), vision_config=vision, image_token_id=261)
    if family == "kimi_k25":
        from transformers.models.kimi_k25 import Kimi_K25Config

        # MoonViT: patch 14, a 16x16 learned position grid (bicubically resampled), 2x2 merge.
        vision = dict(
            patch_size=14, pos_emb_height=16, pos_emb_width=16, pos_emb_time=4, num_attention_heads=2,
            num_hidden_layers=3, hidden_size=32, intermediate_size=64,
            rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
        )
        return Kimi_K25Config(text_config=_kimi_text(dict(TEXT), lm_scale), vision_config=vision,
                              projection_hidden_size=32, **KIMI_TOKEN_IDS)
    raise ValueError(f"unknown tiny family {family!r}; choose from {', '.join(FAMILIES)}")


def image_processor_config(family: str) -> dict:
    """preprocessor_config.json: a real checkpoint's, with the small tiny pixel bounds."""
    if family == "internvl":
        return dict(
            image_processor_type="GotOcr2ImageProcessor", crop_to_patches=True, do_convert_rgb=True,
            do_normalize=True, do_rescale=True, do_resize=True, image_mean=[0.485, 0.456, 0.406],
            image_std=[0.229, 0.224, 0.225], max_patches=INTERNVL_MAX_TILES, min_patches=1, resample=3,
            rescale_factor=1 / 255, size={"height": 448, "width": 448},
        )
    if family == "kimi_k25":
        # Kimi_K25ImageProcessor's class defaults; size.max_height counts patches per side.
        return dict(
            image_processor_type="Kimi_K25ImageProcessor", do_convert_rgb=True, do_normalize=True,
            do_rescale=True, do_resize=True, image_mean=IMAGENET_STANDARD, image_std=IMAGENET_STANDARD,
            max_patches=KIMI_MAX_PATCHES, merge_size=2, patch_size=14, resample=3, rescale_factor=1 / 255,
            size={"max_height": 512, "max_width": 512},
        )
    patch16 = family in ("qwen3_vl", "qwen3_5", "qwen3_5_moe")
    return dict(
        image_processor_type="Qwen2VLImageProcessor", do_convert_rgb=True, do_normalize=True, do_rescale=True,
        do_resize=True, image_mean=IMAGENET_STANDARD if patch16 else CLIP_MEAN,
        image_std=IMAGENET_STANDARD if patch16 else CLIP_STD, merge_size=2, patch_size=16 if patch16 else 14,
        resample=3, rescale_factor=1 / 255, size={"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        temporal_patch_size=2,
    )


def video_processor_config(family: str) -> dict | None:
    """video_preprocessor_config.json of the Qwen families, None for the others.

    The class defaults of the video processor transformers maps the family to
    (``Qwen2VLVideoProcessor`` for Qwen2/2.5-VL, ``Qwen3VLVideoProcessor`` for
    Qwen3-VL and Qwen3.5), as a real checkpoint's file holds them, with small pixel
    and frame bounds. Written by hand: those classes need torchvision to instantiate.
    """
    if family not in QWEN_FAMILIES:
        return None
    common = dict(
        do_convert_rgb=True, do_normalize=True, do_rescale=True, do_resize=True, merge_size=2, min_frames=4,
        max_frames=MAX_FRAMES, resample=3, rescale_factor=1 / 255, temporal_patch_size=2,
        size={"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
    )
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return dict(common, video_processor_type="Qwen2VLVideoProcessor", patch_size=14, image_mean=CLIP_MEAN,
                    image_std=CLIP_STD, do_sample_frames=False)
    return dict(common, video_processor_type="Qwen3VLVideoProcessor", patch_size=16, image_mean=IMAGENET_STANDARD,
                image_std=IMAGENET_STANDARD, do_sample_frames=True, fps=2)


def tokenizer_specials(family: str) -> tuple[tuple[str, ...], dict[str, str], str, str]:
    """(special tokens with ids from 256 up, extra named tokens, eos token, pad token)."""
    if family == "internvl":
        return INTERNVL_SPECIALS, {
            "start_image_token": "<img>", "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>",
        }, "<|im_end|>", "<|endoftext|>"
    if family == "kimi_k25":
        return KIMI_SPECIALS, {
            "image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>",
        }, "[EOS]", "[BOS]"
    return QWEN_SPECIALS, {
        "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
    }, "<|im_end|>", "<|endoftext|>"
