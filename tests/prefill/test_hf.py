# SPDX-License-Identifier: Apache-2.0
"""Prefill assembly on precomputed embeddings equals the aggregated pixel path, bitwise."""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from epd_encoder.errors import InvalidInput, UnsupportedModel
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.prefill import (
    build_generate_kwargs,
    build_prefill_inputs,
    expand_image_placeholders,
    greedy_generate,
    prefill_forward,
)
from epd_encoder.preprocess.registry import load_preprocessor

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"]
SIZES = [(64, 96), (120, 80), (150, 200)]  # (h, w): three different grids


@dataclass(frozen=True)
class Item:
    embedding: torch.Tensor
    deepstack: list[torch.Tensor] | None
    grid_thw: tuple[int, int, int]


@dataclass
class Setup:
    model: object
    tok: object
    pre: object
    images: list


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    d = write_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "m")
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    rng = np.random.default_rng(7)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    return Setup(model, AutoTokenizer.from_pretrained(d), load_preprocessor(d), images)


def prompt(tok, n_images: int, text: str) -> list[int]:
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    body = "".join(f"Picture {i + 1}: {vision}\n" for i in range(n_images))
    chat = f"<|im_start|>user\n{body}{text}<|im_end|>\n<|im_start|>assistant\n"
    return tok(chat)["input_ids"]


def pixel_inputs(s: Setup, images, ids: torch.Tensor) -> dict:
    """What the HF processor hands the aggregated model."""
    pre = [s.pre.preprocess(im) for im in images]
    return {
        "input_ids": ids,
        "pixel_values": torch.cat([p.pixel_values for p in pre]),
        "image_grid_thw": torch.tensor([p.grid_thw for p in pre]),
        "mm_token_type_ids": (ids == s.model.config.image_token_id).int(),
    }


def encode(s: Setup, images) -> list[Item]:
    """The encode tier's side: the model's own visual module on the packed images."""
    pre = [s.pre.preprocess(im) for im in images]
    with torch.no_grad():
        out = s.model.model.get_image_features(
            torch.cat([p.pixel_values for p in pre]), torch.tensor([p.grid_thw for p in pre]), return_dict=True
        )
    deep = getattr(out, "deepstack_features", None)
    return [
        Item(out.pooler_output[i].clone(), None if deep is None else [d[i].clone() for d in deep], p.grid_thw)
        for i, p in enumerate(pre)
    ]


def request(s: Setup, n: int = 3, text: str = "What differs between these?"):
    items = encode(s, s.images[:n])
    ids = expand_image_placeholders(
        prompt(s.tok, n, text), [it.embedding.shape[0] for it in items], s.model.config.image_token_id
    )
    return torch.tensor([ids]), items


def test_logits_equal_aggregated_exactly(setup):
    ids, items = request(setup)
    with torch.no_grad():
        want = setup.model(**pixel_inputs(setup, setup.images, ids)).logits
        official = setup.model(**build_generate_kwargs(setup.model, ids, items)).logits
    explicit, _ = prefill_forward(setup.model, build_prefill_inputs(setup.model, ids, items))
    assert (official - want).abs().max().item() == 0.0
    assert (explicit - want).abs().max().item() == 0.0


def test_greedy_generation_identical(setup):
    ids, items = request(setup)
    n = ids.shape[1]
    with torch.no_grad():
        want = setup.model.generate(
            **pixel_inputs(setup, setup.images, ids), max_new_tokens=5, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
        got = setup.model.generate(**build_generate_kwargs(setup.model, ids, items), max_new_tokens=5,
                                   do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens, logits = greedy_generate(setup.model, build_prefill_inputs(setup.model, ids, items), 5,
                                     return_logits=True)
    assert want.sequences.shape[1] == n + 5
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits, dim=1), torch.stack(want.logits, dim=1))
    assert torch.equal(tokens, want.sequences[:, n:])
    assert torch.equal(logits, torch.stack(want.logits, dim=1))


def test_left_padded_batch_exact(setup):
    cfg = setup.model.config
    # Encoded in one packed forward, as the aggregated model does: this tests assembly, not the tower.
    items = encode(setup, setup.images)
    a_items, b_items = items[:2], items[2:]
    a = expand_image_placeholders(prompt(setup.tok, 2, "Compare them, in detail."),
                                  [it.embedding.shape[0] for it in a_items], cfg.image_token_id)
    b = expand_image_placeholders(prompt(setup.tok, 1, "Hm?"),
                                  [it.embedding.shape[0] for it in b_items], cfg.image_token_id)
    width, pad = max(len(a), len(b)), setup.tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in (a, b)])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in (a, b)])
    assert mask[1].sum() < width  # the second row really is padded
    with torch.no_grad():
        agg = dict(pixel_inputs(setup, setup.images, ids), attention_mask=mask)
        want_logits = setup.model(**agg).logits
        want = setup.model.generate(**agg, max_new_tokens=4, do_sample=False)
        official = setup.model(**build_generate_kwargs(setup.model, ids, items, mask)).logits
    inputs = build_prefill_inputs(setup.model, ids, items, mask)
    explicit, _ = prefill_forward(setup.model, inputs)
    assert (official - want_logits).abs().max().item() == 0.0
    assert (explicit - want_logits).abs().max().item() == 0.0
    assert torch.equal(greedy_generate(setup.model, inputs, 4), want[:, width:])
    # Stopping: row 0 ends on its second token and is padded after it, as generate does.
    eos = int(want[0, width + 1])
    with torch.no_grad():
        stopped = setup.model.generate(**agg, max_new_tokens=4, do_sample=False, eos_token_id=eos)
    mine = greedy_generate(setup.model, inputs, 4, eos_token_id=eos)
    assert torch.equal(mine, stopped[:, width:])
    assert (mine[0, 2:] == setup.model.generation_config.pad_token_id).all()


def test_positions_are_mrope_from_the_grids(setup):
    ids, items = request(setup)
    inputs = build_prefill_inputs(setup.model, ids, items)
    assert inputs.position_ids.shape == (3, 1, ids.shape[1])
    # Images take fewer positions than tokens, so the sequence ends before its length.
    assert inputs.rope_deltas.item() < 0
    assert inputs.position_ids.max().item() + 1 - ids.shape[1] == inputs.rope_deltas.item()
    first = (ids[0] == setup.model.config.image_token_id).nonzero()[0].item()
    _, h, w = items[0].grid_thw
    merge = setup.model.config.vision_config.spatial_merge_size
    rows = inputs.position_ids[:, 0, first:first + items[0].embedding.shape[0]]
    assert torch.equal(rows[1].unique(), torch.arange(h // merge) + first)
    assert torch.equal(rows[2].unique(), torch.arange(w // merge) + first)


def test_deepstack_reaches_the_text_model(setup):
    ids, items = request(setup)
    if items[0].deepstack is None:
        assert build_prefill_inputs(setup.model, ids, items).deepstack_visual_embeds is None
        return
    inputs = build_prefill_inputs(setup.model, ids, items)
    assert len(inputs.deepstack_visual_embeds) == len(setup.model.config.vision_config.deepstack_visual_indexes)
    assert int(inputs.visual_pos_masks.sum()) == sum(it.embedding.shape[0] for it in items)
    zeroed = [replace(it, deepstack=[torch.zeros_like(d) for d in it.deepstack]) for it in items]
    with torch.no_grad():
        full = setup.model(**build_generate_kwargs(setup.model, ids, items)).logits
        without = setup.model(**build_generate_kwargs(setup.model, ids, zeroed)).logits
    assert (full - without).abs().max().item() > 1e-4


def test_wrong_token_count_raises(setup):
    ids, items = request(setup)
    token = setup.model.config.image_token_id
    first = (ids[0] == token).nonzero()[0].item()
    short = torch.cat([ids[:, :first], ids[:, first + 1:]], dim=1)  # image 0 one token short
    n0 = items[0].embedding.shape[0]
    for build in (build_generate_kwargs, build_prefill_inputs):
        with pytest.raises(InvalidInput, match=rf"image 0: prompt has {n0 - 1} placeholder tokens, item has {n0}"):
            build(setup.model, short, items)
        with pytest.raises(InvalidInput, match=r"3 image placeholder runs .* but 2 items"):
            build(setup.model, ids, items[:2])


def test_malformed_items_raise(setup):
    ids, items = request(setup)
    bad_rows = [replace(items[0], embedding=items[0].embedding[:-1]), *items[1:]]
    with pytest.raises(InvalidInput, match="item 0: embedding shape"):
        build_prefill_inputs(setup.model, ids, bad_rows)
    if items[0].deepstack is None:
        extra = [replace(it, deepstack=[it.embedding]) for it in items]
        with pytest.raises(InvalidInput, match="1 deepstack tensors"):
            build_generate_kwargs(setup.model, ids, extra)
    else:
        missing = [replace(items[0], deepstack=None), *items[1:]]
        with pytest.raises(InvalidInput, match="item 0: 0 deepstack tensors"):
            build_generate_kwargs(setup.model, ids, missing)
    video = ids.clone()
    video[0, 0] = setup.model.config.video_token_id
    with pytest.raises(InvalidInput, match="video placeholders"):
        build_generate_kwargs(setup.model, video, items)
    with pytest.raises(InvalidInput, match="attention_mask shape"):
        build_prefill_inputs(setup.model, ids, items, torch.ones(1, ids.shape[1] - 1))


def test_expand_image_placeholders():
    assert expand_image_placeholders([1, 9, 2, 9, 3], [2, 3], 9) == [1, 9, 9, 2, 9, 9, 9, 3]
    assert expand_image_placeholders(torch.tensor([9, 4]), [1], 9) == [9, 4]
    assert expand_image_placeholders([1, 2], [], 9) == [1, 2]
    with pytest.raises(InvalidInput, match="2 image placeholders .* but 1 images"):
        expand_image_placeholders([9, 9], [4], 9)
    with pytest.raises(InvalidInput, match="at least 1"):
        expand_image_placeholders([9], [0], 9)


def test_unsupported_model_raises():
    fake = SimpleNamespace(config=SimpleNamespace(model_type="llava"))
    with pytest.raises(UnsupportedModel, match="llava"):
        build_generate_kwargs(fake, [1, 2], [])
