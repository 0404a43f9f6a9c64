# SPDX-License-Identifier: Apache-2.0
"""Video (and mixed image+video) prefill on encode-tier embeddings equals the aggregated model.

The aggregated side is the transformers model on ``pixel_values_videos`` +
``video_grid_thw`` (+ ``second_per_grid_ts``), with the prompt text its
processor writes (transformers' own ``replace_video_token``, so Qwen3-VL's
``<t seconds>`` text is the processor's). The EPD side encodes the same
pixels with our tower (``load_vision_model``) and assembles with
``prefill.hf``. As in test_hf.py: the reference tower on the same packed
pixels is transformers' module on the same input, so the logits are equal
exactly; the fast tower adds floats in another order, so within 1e-4.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
from transformers.video_utils import VideoMetadata

from epd_encoder.errors import InvalidInput
from epd_encoder.models import tiny
from epd_encoder.models.registry import load_vision_model
from epd_encoder.prefill import (
    PrefillItem,
    as_video,
    build_generate_kwargs,
    build_prefill_inputs,
    expand_vision_placeholders,
    frame_timestamps,
    greedy_generate,
    prefill_forward,
)
from epd_encoder.prefill.hf import SUPPORTED_MODEL_TYPES

# Qwen3.5 joins once its tiny checkpoint and prefill support exist.
FAMILIES = [f for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
            if f in tiny.FAMILIES and f in SUPPORTED_MODEL_TYPES]
VISION = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
          "video": "<|vision_start|><|video_pad|><|vision_end|>"}
# (t, h, w) in patches; t >= 2 for videos. Multiples of the merge size (2).
GRIDS = {"v0": (2, 8, 12), "v1": (3, 4, 8), "i0": (1, 8, 8), "i1": (1, 6, 4)}
SAMPLED_FPS = {"v0": 4.0, "v1": 2.0}  # frames sampled from a 24 fps source


@dataclass
class Fam:
    name: str
    model: object
    tok: object
    ref: object  # reference tower: transformers' module
    fast: object  # our fast tower
    pixels: dict  # media name -> [t*h*w, C*T*P*P]


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory):
    d = tiny.write_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "m")
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    w = model.model.visual.patch_embed.proj.weight
    g = torch.Generator().manual_seed(11)
    pixels = {k: torch.randn(t * h * ww, w[0].numel(), generator=g) for k, (t, h, ww) in GRIDS.items()}
    return Fam(request.param, model, AutoTokenizer.from_pretrained(d),
               load_vision_model(d, tower="reference", progress=False).tower,
               load_vision_model(d, progress=False).tower, pixels)


def temporal_patch(fam: Fam) -> int:
    return int(fam.model.config.vision_config.temporal_patch_size)


def metadata(fam: Fam, name: str) -> VideoMetadata:
    t = GRIDS[name][0] * temporal_patch(fam)
    step = round(24 / SAMPLED_FPS[name])
    return VideoMetadata(total_num_frames=t * step, fps=24.0, frames_indices=list(range(0, t * step, step)))


def encode(fam: Fam, media: list[str], *, fast: bool = False) -> list[PrefillItem]:
    """The encode tier: images in one packed forward, videos in another, as the aggregated model runs them."""
    tower = fam.fast if fast else fam.ref
    out: dict[str, PrefillItem] = {}
    for kind in ("i", "v"):
        names = [m for m in media if m[0] == kind]
        if not names:
            continue
        grids = torch.tensor([GRIDS[m] for m in names])
        with torch.no_grad():
            rows, deep = tower.forward_packed(torch.cat([fam.pixels[m] for m in names]), grids)
        sizes = [tower.tokens_for_grid(GRIDS[m]) for m in names]
        parts = rows.split(sizes)
        deeps = [d.split(sizes) for d in deep] if deep else None
        for j, m in enumerate(names):
            item = PrefillItem(parts[j].clone(), GRIDS[m], None if deeps is None else [d[j].clone() for d in deeps])
            if kind == "v":
                md = metadata(fam, m)
                item = as_video(item, second_per_grid_ts=temporal_patch(fam) / SAMPLED_FPS[m],
                                timestamps=frame_timestamps(md.frames_indices, md.fps, temporal_patch(fam)))
            out[m] = item
    return [out[m] for m in media]


def chat(fam: Fam, media: list[str], text: str = "Describe what happens.") -> str:
    body = "".join(f"{m}: {VISION['video' if m[0] == 'v' else 'image']}\n" for m in media)
    return f"<|im_start|>user\n{body}{text}<|im_end|>\n<|im_start|>assistant\n"


def processor_text(fam: Fam, media: list[str], text: str = "Describe what happens.") -> str:
    """The chat with each placeholder replaced by transformers' processor's own replacement string."""
    proc_cls = getattr(importlib.import_module("transformers"), PROCESSOR_MAPPING_NAMES[fam.name])
    merge = int(fam.model.config.vision_config.spatial_merge_size)
    ns = SimpleNamespace(
        image_processor=SimpleNamespace(merge_size=merge),
        video_processor=SimpleNamespace(merge_size=merge, temporal_patch_size=temporal_patch(fam)),
        image_token="<|image_pad|>", video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
    )
    ns._calculate_timestamps = lambda *a, **k: proc_cls._calculate_timestamps(ns, *a, **k)
    images = [m for m in media if m[0] == "i"]
    videos = [m for m in media if m[0] == "v"]
    vin = {"video_grid_thw": torch.tensor([GRIDS[m] for m in videos]).reshape(-1, 3),
           "video_metadata": [metadata(fam, m) for m in videos]}
    iin = {"image_grid_thw": torch.tensor([GRIDS[m] for m in images]).reshape(-1, 3)}
    out = chat(fam, media, text)
    marks = {"i": iter(range(len(images))), "v": iter(range(len(videos)))}
    for m in media:  # placeholders are replaced in order, one per item (get_text_with_replacements)
        if m[0] == "i":
            out = out.replace(VISION["image"], "\0" + proc_cls.replace_image_token(ns, iin, next(marks["i"])) + "\1", 1)
        else:
            out = out.replace(VISION["video"], "\2" + proc_cls.replace_video_token(ns, vin, next(marks["v"])) + "\3", 1)
    for mark, tok in zip("\0\1\2\3", ("<|vision_start|>", "<|vision_end|>") * 2):
        out = out.replace(mark, tok)
    return out


def aggregated(fam: Fam, media_rows: list[list[str]], ids: torch.Tensor, mask=None) -> dict:
    """What the processor hands the aggregated model: pixels, grids, metadata, type ids."""
    cfg = fam.model.config
    media = [m for row in media_rows for m in row]
    images = [m for m in media if m[0] == "i"]
    videos = [m for m in media if m[0] == "v"]
    kw = {"input_ids": ids,
          "mm_token_type_ids": (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()}
    if images:
        kw["pixel_values"] = torch.cat([fam.pixels[m] for m in images])
        kw["image_grid_thw"] = torch.tensor([GRIDS[m] for m in images])
    if videos:
        kw["pixel_values_videos"] = torch.cat([fam.pixels[m] for m in videos])
        kw["video_grid_thw"] = torch.tensor([GRIDS[m] for m in videos])
        if fam.name == "qwen2_5_vl":
            kw["second_per_grid_ts"] = torch.tensor([temporal_patch(fam) / SAMPLED_FPS[m] for m in videos])
    if mask is not None:
        kw["attention_mask"] = mask
    return kw


def prompt(fam: Fam, media: list[str], items, text: str = "Describe what happens.") -> list[int]:
    ids = fam.tok(chat(fam, media, text))["input_ids"]
    return expand_vision_placeholders(ids, items, fam.model.config, fam.tok)


def check_logits(fam: Fam, media: list[str], *, fast: bool = False) -> None:
    items = encode(fam, media, fast=fast)
    ids = torch.tensor([prompt(fam, media, items)])
    with torch.no_grad():
        want = fam.model(**aggregated(fam, [media], ids)).logits
        official = fam.model(**build_generate_kwargs(fam.model, ids, items)).logits
    explicit, _ = prefill_forward(fam.model, build_prefill_inputs(fam.model, ids, items))
    tol = 1e-4 if fast else 0.0
    assert (official - want).abs().max().item() <= tol
    assert (explicit - want).abs().max().item() <= tol


def test_prompt_is_the_processors(fam):
    for media in (["v0"], ["i0", "v0", "v1", "i1"]):
        items = encode(fam, media)
        want = fam.tok(processor_text(fam, media))["input_ids"]
        assert prompt(fam, media, items) == want
        n_video = (torch.tensor(want) == fam.model.config.video_token_id).sum().item()
        assert n_video == sum(it.embedding.shape[0] for it in items if it.modality == "video") > 0
    if fam.name.startswith("qwen3"):  # the timestamps text really is in the prompt (frames 0, 6 | 12, 18 at 24 fps)
        assert "<0.1 seconds><|vision_start|>" in processor_text(fam, ["v0"])
        assert "<0.6 seconds><|vision_start|>" in processor_text(fam, ["v0"])


def test_video_only_exact(fam):
    check_logits(fam, ["v0"])


def test_mixed_image_video_exact(fam):
    check_logits(fam, ["i0", "v0", "i1"])


def test_two_videos_exact(fam):
    check_logits(fam, ["v0", "i0", "v1"])


def test_fast_tower_within_tolerance(fam):
    check_logits(fam, ["i0", "v0", "v1"], fast=True)


def test_greedy_generation_identical(fam):
    media = ["v0", "i1"]
    items = encode(fam, media)
    ids = torch.tensor([prompt(fam, media, items)])
    n = ids.shape[1]
    gen = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = fam.model.generate(**aggregated(fam, [media], ids), **gen)
        got = fam.model.generate(**build_generate_kwargs(fam.model, ids, items), **gen)
    tokens, logits = greedy_generate(fam.model, build_prefill_inputs(fam.model, ids, items), 5, return_logits=True)
    assert want.sequences.shape[1] == n + 5
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits, dim=1), torch.stack(want.logits, dim=1))
    assert torch.equal(tokens, want.sequences[:, n:])
    assert torch.equal(logits, torch.stack(want.logits, dim=1))


def test_left_padded_batch_exact(fam):
    rows = [["v0", "i0"], ["v1"]]
    # One packed forward per modality over the batch, row-major, as the aggregated model encodes.
    items = encode(fam, [m for row in rows for m in row])
    a = prompt(fam, rows[0], items[:2], "Compare the clip and the picture.")
    b = prompt(fam, rows[1], items[2:], "Hm?")
    width, pad = max(len(a), len(b)), fam.tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in (a, b)])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in (a, b)])
    assert mask.sum(1).min() < width  # one row really is padded
    with torch.no_grad():
        agg = aggregated(fam, rows, ids, mask)
        want_logits = fam.model(**agg).logits
        want = fam.model.generate(**agg, max_new_tokens=4, do_sample=False)
        official = fam.model(**build_generate_kwargs(fam.model, ids, items, mask)).logits
    inputs = build_prefill_inputs(fam.model, ids, items, mask)
    explicit, _ = prefill_forward(fam.model, inputs)
    assert (official - want_logits).abs().max().item() == 0.0
    assert (explicit - want_logits).abs().max().item() == 0.0
    assert torch.equal(greedy_generate(fam.model, inputs, 4), want[:, width:])


def test_video_positions_follow_the_metadata(fam):
    media = ["v0"]
    items = encode(fam, media)
    ids = torch.tensor([prompt(fam, media, items)])
    pos = build_prefill_inputs(fam.model, ids, items).position_ids[0, 0]  # temporal row
    at = ids[0] == fam.model.config.video_token_id
    t, h, w = GRIDS["v0"]
    per_patch = h * w // 4
    first = pos[at][::per_patch]  # temporal position of each temporal patch
    if fam.name == "qwen2_5_vl":
        # tokens_per_second * second_per_grid_ts apart; another fps moves them.
        step = fam.model.config.vision_config.tokens_per_second * items[0].second_per_grid_ts
        assert (first - first[0]).tolist() == [int(k * step) for k in range(t)]
        slower = [replace(items[0], second_per_grid_ts=2 * items[0].second_per_grid_ts)]
        moved = build_prefill_inputs(fam.model, ids, slower).position_ids[0, 0][at][::per_patch]
        assert (moved - moved[0]).tolist() == [int(2 * k * step) for k in range(t)]
    elif fam.name == "qwen2_vl":
        assert (first - first[0]).tolist() == list(range(t))
    else:
        # Timestamped: each temporal patch is its own (1, h, w) block after its timestamp text.
        assert all(b - a > 1 for a, b in zip(first.tolist(), first[1:].tolist()))


def test_wrong_tokens_or_grid_raise_before_any_forward(fam):
    media = ["i0", "v0"]
    items = encode(fam, media)
    ids = torch.tensor([prompt(fam, media, items)])
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *a: calls.append(1)) for m in fam.model.modules()]
    try:
        video_tok = fam.model.config.video_token_id
        first = (ids[0] == video_tok).nonzero()[0].item()
        short = torch.cat([ids[:, :first], ids[:, first + 1:]], dim=1)  # video 0 one token short
        t, h, w = GRIDS["v0"]
        per_run = h * w // 4 if fam.name.startswith("qwen3") else t * h * w // 4
        where = "video 0, temporal patch 0" if fam.name.startswith("qwen3") else "video 0"
        bad_grid = [items[0], replace(items[1], grid_thw=(t + 1, h, w))]
        for build in (build_generate_kwargs, build_prefill_inputs):
            with pytest.raises(InvalidInput, match=rf"{where}: prompt has {per_run - 1} placeholder tokens, "
                                                   rf"item has {per_run} tokens"):
                build(fam.model, short, items)
            with pytest.raises(InvalidInput, match=r"item 1: embedding shape .* grid \(3, 8, 12\)"):
                build(fam.model, ids, bad_grid)
            with pytest.raises(InvalidInput, match="video placeholders: prompt has"):
                build(fam.model, ids, [items[0], items[1], items[1]])  # one video too many
            with pytest.raises(InvalidInput, match="no item has modality 'video'"):
                build(fam.model, ids, [items[0]])
    finally:
        for hk in hooks:
            hk.remove()
    assert calls == []


def test_metadata_is_required(fam):
    items = encode(fam, ["v0"])
    base = fam.tok(chat(fam, ["v0"]))["input_ids"]
    if fam.name.startswith("qwen3"):
        with pytest.raises(InvalidInput, match="pass the tokenizer"):
            expand_vision_placeholders(base, items, fam.model.config)
        with pytest.raises(InvalidInput, match=r"one timestamp per temporal patch \(2\), got 1"):
            expand_vision_placeholders(base, [replace(items[0], timestamps=(0.0,))], fam.model.config, fam.tok)
    else:  # no text in between: the tokenizer is not needed
        assert expand_vision_placeholders(base, items, fam.model.config) == prompt(fam, ["v0"], items)
    ids = torch.tensor([prompt(fam, ["v0"], items)])
    no_seconds = [replace(items[0], second_per_grid_ts=None)]
    if fam.name == "qwen2_5_vl":
        with pytest.raises(InvalidInput, match="needs second_per_grid_ts > 0"):
            build_generate_kwargs(fam.model, ids, no_seconds)
    else:  # unused by this family's positions
        assert "second_per_grid_ts" not in build_generate_kwargs(fam.model, ids, no_seconds)
    with pytest.raises(InvalidInput, match="1 image and 0 video placeholders but the items are 0 images and 1"):
        expand_vision_placeholders(fam.tok(chat(fam, ["i0"]))["input_ids"], items, fam.model.config, fam.tok)


def test_frame_timestamps_match_the_processor():
    from transformers import Qwen3VLProcessor

    ns = SimpleNamespace()
    for frames, fps, tps in (([0, 6, 12, 18], 24.0, 2), ([0, 10, 20, 30, 40], 30.0, 2), ([3, 5, 7], 2.5, 3)):
        want = Qwen3VLProcessor._calculate_timestamps(ns, list(frames), fps, tps)
        assert frame_timestamps(frames, fps, tps) == want
    assert frame_timestamps([0, 6, 12], 24.0) == [0.125, 0.5]  # the incomplete last patch repeats frame 12
    with pytest.raises(InvalidInput):
        frame_timestamps([], 24.0)


def test_client_items_carry_the_metadata_in_their_video_dict(fam):
    from epd_encoder.client import EncodedItem

    media = ["i0", "v0"]
    items = encode(fam, media)
    received = [
        EncodedItem(it.embedding, it.deepstack, f"k{j}", it.embedding.shape[0], it.grid_thw, "miss", it.modality,
                    None if it.modality == "image" else
                    {"frames_indices": [0], "fps": 24.0, "second_per_grid_ts": it.second_per_grid_ts,
                     "timestamps": list(it.timestamps)})
        for j, it in enumerate(items)
    ]
    ids = prompt(fam, media, received)
    assert ids == prompt(fam, media, items)
    got = build_generate_kwargs(fam.model, [ids], received)
    want = build_generate_kwargs(fam.model, [ids], items)
    assert torch.equal(got["mm_token_type_ids"], want["mm_token_type_ids"])
    assert torch.equal(got["video_grid_thw"], want["video_grid_thw"])
    if fam.name == "qwen2_5_vl":
        assert torch.equal(got["second_per_grid_ts"], want["second_per_grid_ts"])
