# SPDX-License-Identifier: Apache-2.0
"""Kimi K2.5: prefill on encode-tier embeddings equals the aggregated model on pixels."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from epd_encoder.errors import InvalidInput
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.invariant import batch_invariant
from epd_encoder.models.registry import load_vision_model
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.prefill import (
    build_generate_kwargs,
    build_prefill_inputs,
    expand_image_placeholders,
    greedy_generate,
    prefill_forward,
)
from epd_encoder.preprocess.registry import load_preprocessor

SIZES = [(64, 96), (120, 80), (150, 200)]
IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


@dataclass(frozen=True)
class Item:
    embedding: torch.Tensor
    deepstack: list[torch.Tensor] | None
    grid_thw: tuple[int, int, int]


@dataclass
class Setup:
    dir: object
    model: object
    tok: object
    pre: object
    images: list


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = write_tiny_model("kimi_k25", tmp_path_factory.mktemp("kimi") / "m")
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    rng = np.random.default_rng(7)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    return Setup(d, model, AutoTokenizer.from_pretrained(d), load_preprocessor(d), images)


def prompt(tok, n: int, text: str) -> list[int]:
    body = "".join(f"Picture {i + 1}: {IMAGE}\n" for i in range(n))
    return tok(f"<|im_user|>user<|im_middle|>{body}{text}<|im_end|><|im_assistant|>assistant<|im_middle|>")[
        "input_ids"]


def pixel_inputs(s: Setup, ids: torch.Tensor) -> dict:
    """What the aggregated model is given: the processor's pixels and grids."""
    pre = [s.pre.preprocess(im) for im in s.images]
    return {"input_ids": ids, "pixel_values": torch.cat([p.pixel_values for p in pre]),
            "image_grid_thw": torch.tensor([p.grid_thw for p in pre])}


def encode_with_model(s: Setup) -> list[Item]:
    """The model's own image path on the packed images (tests assembly alone)."""
    pre = [s.pre.preprocess(im) for im in s.images]
    with torch.no_grad():
        out = s.model.model.get_image_features(torch.cat([p.pixel_values for p in pre]),
                                               torch.tensor([p.grid_thw for p in pre]), return_dict=True)
    return [Item(e.clone(), None, p.grid_thw) for e, p in zip(out.pooler_output, pre)]


def encode_with_server_tower(s: Setup, tower: str, invariant: bool) -> list[Item]:
    """What the encode tier serves: our preprocessing, the loaded tower, the executor."""
    loaded = load_vision_model(s.dir, tower=tower, progress=False)
    pre = [s.pre.preprocess(im) for im in s.images]
    outs = VisionExecutor(loaded.tower, batch_invariant=invariant).encode(pre)
    return [Item(o.embedding, o.deepstack, p.grid_thw) for o, p in zip(outs, pre)]


def request_ids(s: Setup, items, text="What differs between these?") -> torch.Tensor:
    ids = expand_image_placeholders(prompt(s.tok, len(items), text), [it.embedding.shape[0] for it in items],
                                    s.model.config.image_token_id)
    return torch.tensor([ids])


def test_logits_equal_aggregated_exactly(setup):
    items = encode_with_model(setup)
    ids = request_ids(setup, items)
    with torch.no_grad():
        want = setup.model(**pixel_inputs(setup, ids)).logits
        official = setup.model(**build_generate_kwargs(setup.model, ids, items)).logits
    explicit, _ = prefill_forward(setup.model, build_prefill_inputs(setup.model, ids, items))
    assert (official - want).abs().max().item() == 0.0
    assert (explicit - want).abs().max().item() == 0.0
    # The images really feed the logits: other rows change them.
    other = [replace(it, embedding=it.embedding.flip(0)) for it in items]
    with torch.no_grad():
        moved = setup.model(**build_generate_kwargs(setup.model, ids, other)).logits
    assert (moved - want).abs().max().item() > 1e-4


def test_served_embeddings_give_the_aggregated_logits(setup):
    """EPD proof: the encode tier's reference tower under --batch-invariant against the
    aggregated model under batch_invariant is exact; the fast tower agrees to rounding."""
    ids = request_ids(setup, encode_with_model(setup))
    with torch.no_grad(), batch_invariant(setup.model):
        want = setup.model(**pixel_inputs(setup, ids)).logits
    exact = encode_with_server_tower(setup, "reference", invariant=True)
    fast = encode_with_server_tower(setup, "fast", invariant=False)
    with torch.no_grad():
        got = setup.model(**build_generate_kwargs(setup.model, ids, exact)).logits
        close = setup.model(**build_generate_kwargs(setup.model, ids, fast)).logits
    assert (got - want).abs().max().item() == 0.0
    assert (close - want).abs().max().item() <= 1e-4


def test_greedy_generation_identical(setup):
    items = encode_with_model(setup)
    ids = request_ids(setup, items)
    n = ids.shape[1]
    with torch.no_grad():
        want = setup.model.generate(**pixel_inputs(setup, ids), max_new_tokens=5, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
        got = setup.model.generate(**build_generate_kwargs(setup.model, ids, items), max_new_tokens=5,
                                   do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens, logits = greedy_generate(setup.model, build_prefill_inputs(setup.model, ids, items), 5,
                                     eos_token_id=(), return_logits=True)
    assert want.sequences.shape[1] == n + 5
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits, dim=1), torch.stack(want.logits, dim=1))
    assert torch.equal(tokens, want.sequences[:, n:])
    assert torch.equal(logits, torch.stack(want.logits, dim=1))


def test_positions_are_plain_text_positions(setup):
    items = encode_with_model(setup)
    ids = request_ids(setup, items)
    inputs = build_prefill_inputs(setup.model, ids, items)
    assert torch.equal(inputs.position_ids, torch.arange(ids.shape[1])[None])
    assert inputs.rope_deltas.abs().sum() == 0 and inputs.deepstack_visual_embeds is None
    kw = build_generate_kwargs(setup.model, ids, items)
    assert set(kw) == {"input_ids", "mm_encoder_outputs"}


def test_mismatches_raise(setup):
    items = encode_with_model(setup)
    ids = request_ids(setup, items)
    token = setup.model.config.image_token_id
    first = (ids[0] == token).nonzero()[0].item()
    short = torch.cat([ids[:, :first], ids[:, first + 1:]], dim=1)
    n0 = items[0].embedding.shape[0]
    for build in (build_generate_kwargs, build_prefill_inputs):
        with pytest.raises(InvalidInput, match=rf"image 0: prompt has {n0 - 1} placeholder tokens, item has {n0}"):
            build(setup.model, short, items)
        with pytest.raises(InvalidInput, match=r"3 image placeholder runs .* but 2 items"):
            build(setup.model, ids, items[:2])
    with pytest.raises(InvalidInput, match="item 0: embedding shape"):
        build_prefill_inputs(setup.model, ids, [replace(items[0], embedding=items[0].embedding[:-1]), *items[1:]])
    with pytest.raises(InvalidInput, match="deepstack"):
        build_generate_kwargs(setup.model, ids, [replace(it, deepstack=[it.embedding]) for it in items])
    video = ids.clone()
    video[0, 0] = setup.model.config.video_token_id
    with pytest.raises(InvalidInput, match="video placeholders"):
        build_generate_kwargs(setup.model, video, items)
