# SPDX-License-Identifier: Apache-2.0
"""Kimi K2.5 (MoonViT + projector) vs transformers' own modules, from a tiny checkpoint."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.models.towers import kimi_k25
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.invariant import batch_invariant
from epd_encoder.models.kimi_k25_reference import from_transformers, to_transformers
from epd_encoder.models.loading.loader import load_strict, load_vision_weights
from epd_encoder.models.registry import load_vision_model
from epd_encoder.models.tiny import CHECKPOINT_VISION_PREFIXES, tiny_config, write_tiny_model
from epd_encoder.preprocess.registry import load_preprocessor

ATOL_REF = 1e-4
ATOL_BATCH = 1e-5
SIZES = [(64, 64), (120, 200), (300, 90), (448, 448), (20, 500)]
# Packed grids of mixed sizes; (t > 1) clips exercise the frame terms and the frame average.
GRIDS = [(1, 8, 12), (1, 22, 18), (1, 2, 2), (1, 32, 32), (2, 6, 10), (4, 4, 6)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_model("kimi_k25", tmp_path_factory.mktemp("kimi") / "m", num_shards=3)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


@pytest.fixture(scope="module")
def pair():
    """(transformers reference, our tower) on random weights of a non-tiny shape (4 heads)."""
    cfg = tiny_config("kimi_k25")
    cfg.vision_config.num_attention_heads = 4
    torch.manual_seed(0)
    ref = kimi_k25.FAMILY.hf_reference(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)  # large enough that every term matters
    ours = kimi_k25.FAMILY.build_tower(cfg).eval()
    load_strict(ours, ref.state_dict())
    return ref, ours


def _pixels(grids, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(math.prod(x) for x in grids), 3, 14, 14, generator=g)


def _items(d):
    pre = load_preprocessor(d)
    rng = np.random.default_rng(5)
    return [pre.preprocess(Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))) for h, w in SIZES]


def _diff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_loader_reads_only_vision_tensors_and_matches_transformers_loader(ckpt, hf):
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    vision = {k for k in weight_map if k.startswith(CHECKPOINT_VISION_PREFIXES["kimi_k25"])}
    assert any(".wqkv." in k for k in vision) and any(k.startswith("language_model.") for k in weight_map)
    state, report = load_vision_weights(ckpt, kimi_k25.FAMILY.weight_prefixes, progress=False)
    assert len(state) == len(vision)
    lm_files = {f for k, f in weight_map.items() if k not in vision}
    assert set(report.shards_skipped) == lm_files and not lm_files & set(report.shards_opened)
    # Our names, converted as transformers' loader converts the files, give its weights bitwise.
    theirs = {f"vision_tower.{k}": v for k, v in hf.model.vision_tower.state_dict().items()}
    theirs.update({f"mm_projector.{k}": v for k, v in hf.model.mm_projector.state_dict().items()})
    converted = to_transformers(state, hf.config.vision_config.num_attention_heads)
    assert converted.keys() == theirs.keys()
    assert all(torch.equal(converted[k], theirs[k]) for k in theirs)
    assert from_transformers(converted, hf.config.vision_config.num_attention_heads).keys() == state.keys()


@torch.inference_mode()
def test_packed_mixed_batch_matches_transformers(pair):
    ref, ours = pair
    pixels = _pixels(GRIDS)
    want = ref(pixels, torch.tensor(GRIDS)).pooler_output
    got, deep = ours.forward_packed(pixels, torch.tensor(GRIDS))
    assert deep is None and want.abs().max() > 1e-1
    assert got.shape == (sum(ours.tokens_for_grid(g) for g in GRIDS), 48)
    assert _diff(got, want) <= ATOL_REF


@torch.inference_mode()
def test_batched_equals_per_item(pair):
    _, ours = pair
    pixels = _pixels(GRIDS, seed=2)
    batched, _ = ours.forward_packed(pixels, torch.tensor(GRIDS))
    alone, start = [], 0
    for g in GRIDS:
        n = math.prod(g)
        alone.append(ours.forward_packed(pixels[start:start + n], torch.tensor([g]))[0])
        start += n
    assert _diff(batched, torch.cat(alone)) <= ATOL_BATCH


@torch.inference_mode()
def test_each_term_matters(pair):
    """The position grid, the rotary pairing and the frame term each change the output."""
    ref, ours = pair
    grids = [(1, 6, 8), (2, 4, 4)]
    pixels = _pixels(grids, seed=3)
    base, _ = ours.forward_packed(pixels, torch.tensor(grids))
    saved = ours.vision_tower.patch_embed.pos_emb.weight.clone()
    ours.vision_tower.patch_embed.pos_emb.weight.zero_()
    try:
        assert _diff(ours.forward_packed(pixels, torch.tensor(grids))[0], base) > 1e-3
    finally:
        ours.vision_tower.patch_embed.pos_emb.weight.copy_(saved)
    # The grid's orientation (rotary rows vs columns, position taps, merge order) matters.
    swapped = torch.tensor([(1, 8, 6), (2, 4, 4)])
    assert _diff(ours.forward_packed(pixels, swapped)[0][:12], base[:12]) > 1e-3
    assert _diff(ref(pixels, torch.tensor(grids)).pooler_output, base) <= ATOL_REF


def test_tokens_for_grid_and_bad_grids(pair):
    _, ours = pair
    assert ours.tokens_for_grid((1, 32, 32)) == 256 and ours.tokens_for_grid((4, 4, 6)) == 6
    with pytest.raises(ConfigError):
        ours.tokens_for_grid((1, 3, 4))
    with torch.inference_mode():
        with pytest.raises(EncodeFailed, match="patches"):
            ours.forward_packed(_pixels([(1, 4, 4)]), torch.tensor([[1, 4, 6]]))
        with pytest.raises(EncodeFailed, match="frame"):
            ours.forward_packed(_pixels([(5, 2, 2)]), torch.tensor([[5, 2, 2]]))


@torch.inference_mode()
def test_fast_tower_from_checkpoint_equals_transformers_image_features(ckpt, hf):
    loaded = load_vision_model(ckpt, progress=False)
    items = _items(ckpt)
    pixels = torch.cat([it.pixel_values for it in items])
    grid = torch.tensor([it.grid_thw for it in items])
    want = torch.cat(hf.model.get_image_features(pixels, grid, return_dict=True).pooler_output)
    outs = VisionExecutor(loaded.tower).encode(items)
    assert [o.embedding.shape[0] for o in outs] == [it.num_tokens for it in items]
    assert want.abs().max() > 1e-2
    assert _diff(torch.cat([o.embedding for o in outs]), want) <= ATOL_REF
    alone = [VisionExecutor(loaded.tower).encode([it])[0].embedding for it in items]
    assert _diff(torch.cat([o.embedding for o in outs]), torch.cat(alone)) <= ATOL_BATCH
    VisionExecutor(loaded.tower).warmup()


@pytest.mark.parametrize("tower", ["fast", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_is_bitwise(ckpt, tower, dtype):
    loaded = load_vision_model(ckpt, tower=tower, dtype=dtype, progress=False)
    ex = VisionExecutor(loaded.tower, dtype=dtype, batch_invariant=True)
    items = [type(it)(it.pixel_values.to(dtype), it.grid_thw, it.num_tokens) for it in _items(ckpt)]
    alone = [ex.encode([it])[0].embedding for it in items]
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 1, 3, 3]):
        for i, out in zip(order, ex.encode([items[i] for i in order])):
            assert torch.equal(out.embedding, alone[i])


@torch.inference_mode()
def test_reference_tower_and_aggregated_model_agree_bitwise(ckpt, hf):
    """Alone, the reference tower is transformers' image path on the same input; under
    ``batch_invariant`` the aggregated model's packed call equals our invariant executor."""
    items = _items(ckpt)
    loaded = load_vision_model(ckpt, tower="reference", progress=False)
    for it in items[:2]:
        want = hf.model.get_image_features(it.pixel_values, torch.tensor([it.grid_thw]), return_dict=True)
        assert torch.equal(VisionExecutor(loaded.tower).encode([it])[0].embedding, want.pooler_output[0])
    pixels = torch.cat([it.pixel_values for it in items])
    grid = torch.tensor([it.grid_thw for it in items])
    with batch_invariant(hf):
        packed = hf.model.get_image_features(pixel_values=pixels, image_grid_thw=grid, return_dict=True)
    assert "get_image_features" not in hf.model.__dict__  # undone on exit
    assert len(packed.pooler_output) == len(items)
    inv = VisionExecutor(loaded.tower, batch_invariant=True).encode(items)
    for got, want in zip(inv, packed.pooler_output):
        assert torch.equal(got.embedding, want)
