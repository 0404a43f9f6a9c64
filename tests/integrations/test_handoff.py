# SPDX-License-Identifier: Apache-2.0
"""The engine hand-off structures (epd_encoder.integrations.handoff) match the documented schema and,
fed to transformers through epd_encoder.prefill, give the aggregated model's logits exactly.

vLLM 0.32 itself takes these structures in tests/integrations/test_vllm_embeds.py; the
schema checked here is the one it reads (its Qwen2-VL/Qwen3-VL data parsers and chat_utils).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from epd_encoder.client import EncodedItem
from epd_encoder.integrations import sglang_image_data, split_embeds, stack_items, vllm_multi_modal_data
from epd_encoder.integrations.handoff import vllm_embeds_part
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.prefill import build_generate_kwargs, expand_image_placeholders
from epd_encoder.preprocess.registry import load_preprocessor
from epd_encoder.receiver import ReceivedItem

SIZES = [(64, 96), (120, 80), (150, 200)]


def received(emb, grid, deep=None, modality="image", video=None, i=0) -> ReceivedItem:
    return ReceivedItem(emb, deep, f"{i:064x}", emb.shape[0], grid, modality, video)


def fake(grid, hidden=8, n_deep=0, modality="image", video=None, i=0, dtype=torch.bfloat16):
    n = grid[0] * grid[1] * grid[2] // 4
    g = torch.Generator().manual_seed(i)
    emb = torch.randn(n, hidden, generator=g).to(dtype)
    deep = [torch.randn(n, hidden, generator=g).to(dtype) for _ in range(n_deep)] or None
    return received(emb, grid, deep, modality, video, i)


def test_vllm_structure_matches_the_documented_schema():
    vid_meta = {"frames_indices": [0, 12, 24, 36], "fps": 24.0, "second_per_grid_ts": 1.0}
    items = [fake((1, 4, 6), i=0), fake((2, 4, 4), modality="video", video=vid_meta, i=1), fake((1, 2, 2), i=2)]
    data = vllm_multi_modal_data(items)
    assert set(data) == {"image", "video"}
    img = data["image"]
    assert set(img) == {"image_embeds", "image_grid_thw"}
    assert img["image_grid_thw"].dtype == torch.int64 and img["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2]]
    assert img["image_embeds"].shape == (6 + 1, 8) and img["image_embeds"].dtype == torch.bfloat16
    assert torch.equal(img["image_embeds"], torch.cat([items[0].embedding, items[2].embedding]))  # prompt order
    vid = data["video"]
    assert set(vid) == {"video_embeds", "video_grid_thw", "second_per_grid_ts"}
    assert vid["video_grid_thw"].tolist() == [[2, 4, 4]] and torch.equal(vid["video_embeds"], items[1].embedding)
    assert vid["second_per_grid_ts"].tolist() == [1.0]
    assert set(vllm_multi_modal_data(items[:1])) == {"image"}  # no empty modality


def test_vllm_qwen3_videos_carry_their_timestamps():
    # vLLM 0.32 requires "timestamps" beside Qwen3-VL/Qwen3.5 video_embeds (Qwen3VLMultiModalDataParser:
    # a metadata field, from which it writes each temporal group's "<t seconds>" text).
    metas = [{"frames_indices": [0, 4, 8, 12], "fps": 8.0, "timestamps": [0.25, 1.25]},
             {"frames_indices": [0, 2], "fps": 4.0, "timestamps": [0.25]}]
    items = [fake((2, 4, 4), modality="video", video=metas[0], i=0), fake((1, 4, 4), modality="video", video=metas[1], i=1)]
    vid = vllm_multi_modal_data(items)["video"]
    assert set(vid) == {"video_embeds", "video_grid_thw", "timestamps"}
    assert [t.tolist() for t in vid["timestamps"]] == [[0.25, 1.25], [0.25]]


def test_vllm_embeds_part_is_the_chat_api_content_part():
    import base64
    import io

    meta = {"frames_indices": [0, 4, 8, 12], "fps": 8.0, "timestamps": [0.25, 1.25]}
    image, video = fake((1, 4, 6), n_deep=2, i=0), fake((2, 4, 4), modality="video", video=meta, i=1)
    part = vllm_embeds_part(image, uuid="k" * 64)
    assert set(part) == {"type", "image_embeds", "uuid"} and part["type"] == "image_embeds"
    payload = part["image_embeds"]
    assert set(payload) == {"image_embeds", "image_grid_thw"} and payload["image_grid_thw"] == [1, 4, 6]
    rows = torch.load(io.BytesIO(base64.b64decode(payload["image_embeds"])), weights_only=True)  # as vLLM loads it
    assert torch.equal(rows, torch.cat([image.embedding, *image.deepstack], dim=-1))
    vpart = vllm_embeds_part(video)
    assert vpart["type"] == "video_embeds" and "uuid" not in vpart
    assert vpart["video_embeds"]["timestamps"] == [0.25, 1.25] and vpart["video_embeds"]["video_grid_thw"] == [2, 4, 4]
    q25 = vllm_embeds_part(fake((2, 4, 4), modality="video", video={"second_per_grid_ts": 0.5}, i=2))["video_embeds"]
    spg = torch.load(io.BytesIO(base64.b64decode(q25["second_per_grid_ts"])), weights_only=True)
    assert set(q25) == {"video_embeds", "video_grid_thw", "second_per_grid_ts"} and spg.item() == 0.5


def test_deepstack_travels_concatenated_on_the_hidden_axis_and_splits_back():
    items = [fake((1, 4, 4), n_deep=3, i=0), fake((1, 2, 6), n_deep=3, i=1)]
    embeds, grid = stack_items(items)
    assert embeds.shape == (4 + 3, 8 * 4)
    back = split_embeds(embeds, grid, num_deepstack=3, hidden_size=8)
    for want, got in zip(items, back):
        assert got.grid_thw == want.grid_thw and torch.equal(got.embedding, want.embedding)
        assert all(torch.equal(a, b) for a, b in zip(got.deepstack, want.deepstack)) and len(got.deepstack) == 3


@pytest.mark.parametrize("wrong", [3, 5])
def test_split_embeds_refuses_a_num_deepstack_that_does_not_match_the_lm_width(wrong):
    # Qwen3-VL rows 144 wide: a 48-wide LM with 2 deepstack layers. 144 also divides by 4 and 6,
    # so only the LM width tells a wrong num_deepstack from a right one.
    items = [fake((1, 4, 4), hidden=48, n_deep=2, i=0), fake((1, 2, 6), hidden=48, n_deep=2, i=1)]
    embeds, grid = stack_items(items)
    assert embeds.shape[-1] == 144
    want = r"144 wide.*hidden_size 48 with num_deepstack=%d.*holds num_deepstack=2" % wrong
    with pytest.raises(ValueError, match=want):
        split_embeds(embeds, grid, num_deepstack=wrong, hidden_size=48)
    back = split_embeds(embeds, grid, num_deepstack=2, hidden_size=48)
    assert [tuple(b.embedding.shape) for b in back] == [(4, 48), (3, 48)] and len(back[0].deepstack) == 2


@pytest.mark.parametrize("n_deep, hidden, hint", [
    (4, 48, "no multiple of hidden_size|holds num_deepstack"), (-1, 48, "num_deepstack"),
    (4, 50, "no multiple of hidden_size"), (2, 0, "hidden_size must be"), (2, None, "hidden_size must be")])
def test_split_embeds_refuses_a_width_it_cannot_split(n_deep, hidden, hint):
    with pytest.raises(ValueError, match=hint):
        split_embeds(torch.zeros(4, 144), [[1, 4, 4]], num_deepstack=n_deep, hidden_size=hidden)


def test_split_embeds_needs_the_lm_width():
    with pytest.raises(TypeError, match="hidden_size"):
        split_embeds(torch.zeros(4, 144), [[1, 4, 4]], num_deepstack=3)  # type: ignore[call-arg]


def test_split_embeds_refuses_rows_that_do_not_match_the_grids():
    with pytest.raises(ValueError, match=r"5 rows.*grids \[\(1, 4, 4\)\] need 4"):
        split_embeds(torch.zeros(5, 8), [[1, 4, 4]], hidden_size=8)


def test_sglang_structure_and_its_refusals():
    items = [fake((1, 4, 6), i=0), fake((1, 2, 2), i=1)]
    (entry,) = sglang_image_data(items)
    assert set(entry) == {"modality", "image_grid_thw", "precomputed_embeddings"} and entry["modality"] == "IMAGE"
    assert entry["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2]]
    assert entry["precomputed_embeddings"].shape == (7, 8)
    video = fake((2, 4, 4), modality="video", video={"frames_indices": [0, 1, 2, 3], "fps": 2.0}, i=2)
    with pytest.raises(ValueError, match="images only"):
        sglang_image_data([*items, video])
    with pytest.raises(ValueError, match="no embedding"):
        sglang_image_data([EncodedItem(None, None, "0" * 64, 6, (1, 4, 6), "hit")])
    with pytest.raises(ValueError, match="needs 6"):
        stack_items([received(torch.zeros(5, 8), (1, 4, 6))])
    with pytest.raises(ValueError, match="disagree on width"):
        stack_items([fake((1, 2, 2), n_deep=1), fake((1, 2, 2))])


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def fam(request, tmp_path_factory):
    d = write_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "m")
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    rng = np.random.default_rng(11)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    return model, AutoTokenizer.from_pretrained(d), load_preprocessor(d), images


def test_transformers_as_consumer_of_both_structures_equals_aggregated(fam):
    model, tok, pre, images = fam
    pp = [pre.preprocess(im) for im in images]
    pixels, grid = torch.cat([p.pixel_values for p in pp]), torch.tensor([p.grid_thw for p in pp])
    with torch.no_grad():  # the encode tier's side: the model's visual module (as tests/prefill/test_hf.py)
        out = model.model.get_image_features(pixels, grid, return_dict=True)
    deep = getattr(out, "deepstack_features", None)
    items = [received(out.pooler_output[i].clone(), p.grid_thw,
                      None if deep is None else [d[i].clone() for d in deep], i=i) for i, p in enumerate(pp)]
    n_deep = 0 if deep is None else len(deep)
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    chat = "<|im_start|>user\n" + "".join(f"Picture {i}: {vision}\n" for i in range(3)) + "Differences?<|im_end|>\n"
    ids = torch.tensor([expand_image_placeholders(tok(chat)["input_ids"], [it.num_tokens for it in items],
                                                  model.config.image_token_id)])
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                     mm_token_type_ids=(ids == model.config.image_token_id).int()).logits
        vllm = vllm_multi_modal_data(items)["image"]
        (sgl,) = sglang_image_data(items)
        for embeds, grids in ((vllm["image_embeds"], vllm["image_grid_thw"]),
                              (sgl["precomputed_embeddings"], sgl["image_grid_thw"])):
            lm_width = model.config.text_config.hidden_size
            assert embeds.shape[-1] == lm_width * (1 + n_deep)
            back = split_embeds(embeds, grids, num_deepstack=n_deep, hidden_size=lm_width)
            got = model(**build_generate_kwargs(model, ids, back)).logits
            assert (got - want).abs().max().item() == 0.0
