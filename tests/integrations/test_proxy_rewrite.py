# SPDX-License-Identifier: Apache-2.0
"""The proxy's request rewriting (epd_encoder.integrations.proxy_rewrite) on every content-part
shape vLLM 0.32's chat parser takes; the real vLLM reading these parts is tests/integrations/test_proxy_vllm.py."""

from __future__ import annotations

import base64
import copy
import io

import pytest
import torch

from epd_encoder.client import EncodedItem
from epd_encoder.integrations.handoff import vllm_embeds_part
from epd_encoder.integrations.proxy_rewrite import (MediaPart, embeds_part, media_parts, original_part,
                                                    pixel_bounds, rewrite, uuid_part)

PNG = "data:image/png;base64,iVBORw0KGgo="
MP4 = "data:video/mp4;base64,AAAAIGZ0eXA="


def item(grid=(1, 4, 6), hidden=8, n_deep=0, modality="image", video=None, seed=0) -> EncodedItem:
    n = grid[0] * grid[1] * grid[2] // 4
    g = torch.Generator().manual_seed(seed)
    deep = [torch.randn(n, hidden, generator=g) for _ in range(n_deep)] or None
    return EncodedItem(torch.randn(n, hidden, generator=g), deep, f"{seed:064x}", n, grid, "miss",
                       modality, video)


def load(b64: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)  # as vLLM loads it


def chat(*content, system: str | None = "be brief") -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"model": "m", "messages": messages + [{"role": "user", "content": list(content)}],
            "max_tokens": 4}


def test_text_only_requests_have_no_media_parts():
    assert media_parts(chat({"type": "text", "text": "hi"})) == []
    assert media_parts({"messages": [{"role": "user", "content": "a string"}]}) == []
    for odd in (None, [], {"messages": "x"}, {"messages": [None, 3, {"content": [None, 7]}]}):
        assert media_parts(odd) == []  # vLLM answers these as it would


def test_every_media_part_shape_is_found_in_prompt_order():
    body = chat(
        {"type": "text", "text": "compare"},
        {"type": "image_url", "image_url": {"url": PNG}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg", "detail": "auto"}},
        {"type": "input_image", "image_url": PNG},                            # Responses-style
        {"image_url": "https://example.com/b.png", "uuid": "mine"},            # untyped, with a uuid
        {"type": "video_url", "video_url": {"url": MP4}},
        {"type": "image_url", "image_url": None, "uuid": "cached"},            # a uuid-only reference
        {"type": "image_embeds", "image_embeds": "AAAA"},                      # already an embedding
    )
    body["messages"].append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]})
    assert media_parts(body) == [
        MediaPart(1, 1, "image", PNG), MediaPart(1, 2, "image", "https://example.com/a.jpg"),
        MediaPart(1, 3, "image", PNG), MediaPart(1, 4, "image", "https://example.com/b.png"),
        MediaPart(1, 5, "video", MP4), MediaPart(2, 0, "image", PNG),
    ]


def test_encode_items_carry_the_url_as_given():
    assert MediaPart(0, 0, "image", PNG).encode_item() == {"type": "image_url", "image_url": {"url": PNG}}
    http = MediaPart(0, 0, "image", "http://h/x.png").encode_item()  # the tier fetches it, if allowed
    assert http == {"type": "image_url", "image_url": {"url": "http://h/x.png"}}
    assert MediaPart(0, 0, "video", MP4).encode_item() == {"type": "video_url", "video_url": {"url": MP4}}


def test_an_image_becomes_vllms_image_embeds_part():
    it = item(grid=(1, 4, 6))
    part = embeds_part(it, {"type": "image_url", "image_url": {"url": PNG}})
    assert set(part) == {"type", "image_embeds", "uuid"} and part["type"] == "image_embeds"
    assert part["uuid"] == it.key
    payload = part["image_embeds"]
    assert set(payload) == {"image_embeds", "image_grid_thw"}
    assert payload["image_grid_thw"] == [1, 4, 6]  # a metadata field: vLLM takes a JSON array
    assert torch.equal(load(payload["image_embeds"]), it.embedding)


def test_deepstack_rides_concatenated_on_the_hidden_axis():
    it = item(n_deep=3)
    rows = load(embeds_part(it, {})["image_embeds"]["image_embeds"])
    assert rows.shape == (6, 8 * 4)
    assert torch.equal(rows, torch.cat([it.embedding, *it.deepstack], dim=-1))


def test_the_clients_uuid_is_kept():
    assert embeds_part(item(), {"uuid": "client-id"})["uuid"] == "client-id"
    it = item()
    assert embeds_part(it, {"uuid": ""})["uuid"] == it.key  # an empty uuid names nothing


@pytest.mark.parametrize("it", [
    item(n_deep=2),
    item(grid=(2, 4, 4), modality="video", video={"timestamps": [0.25, 1.5]}),
    item(grid=(2, 4, 4), modality="video", video={"second_per_grid_ts": 1.0}),
], ids=["deepstack-image", "qwen3-video", "qwen25-video"])
def test_the_proxy_part_is_the_one_builders_part(it):
    """One builder (handoff.vllm_embeds_part, checked against real vLLM) makes every embeds part."""
    ours, theirs = embeds_part(it, {}), vllm_embeds_part(it, uuid=it.key)
    kind = f"{it.modality}_embeds"
    assert set(ours) == set(theirs) and ours["type"] == theirs["type"] and ours["uuid"] == theirs["uuid"]
    assert set(ours[kind]) == set(theirs[kind])
    for field, value in ours[kind].items():
        other = theirs[kind][field]
        same = (torch.equal(load(value), load(other)) if isinstance(value, str) else value == other)
        assert same, field


@pytest.mark.parametrize("video, extra", [
    ({"frames_indices": [0, 12], "fps": 24.0, "total_num_frames": 48, "timestamps": [0.25, 1.5]},
     "timestamps"),                                                     # Qwen3-VL, Qwen3.5
    ({"frames_indices": [0, 12], "fps": 24.0, "total_num_frames": 48, "second_per_grid_ts": 1.0},
     "second_per_grid_ts"),                                             # Qwen2.5-VL
])
def test_a_video_becomes_vllms_video_embeds_part_with_its_timing(video, extra):
    it = item(grid=(2, 4, 4), modality="video", video=video)
    part = embeds_part(it, {"type": "video_url", "video_url": {"url": MP4}})
    payload = part["video_embeds"]
    assert part["type"] == "video_embeds"
    assert set(payload) == {"video_embeds", "video_grid_thw", extra}
    assert payload["video_grid_thw"] == [2, 4, 4] and torch.equal(load(payload["video_embeds"]), it.embedding)
    if extra == "timestamps":
        assert payload["timestamps"] == [0.25, 1.5]
    else:
        assert load(payload["second_per_grid_ts"]).item() == 1.0


def test_uuid_mode_only_adds_the_key():
    original = {"type": "image_url", "image_url": {"url": PNG}, "uuid": "theirs"}
    assert uuid_part("k" * 64, original) == {"type": "image_url", "image_url": {"url": PNG}, "uuid": "k" * 64}
    assert original["uuid"] == "theirs"


def test_rewrite_replaces_each_part_and_leaves_the_clients_body_alone():
    body = chat({"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": PNG}},
                {"type": "text", "text": "b"}, {"type": "image_url", "image_url": {"url": PNG}})
    before = copy.deepcopy(body)
    parts = media_parts(body)
    out = rewrite(body, parts, [{"new": 0}, {"new": 1}])
    assert body == before
    assert out["messages"][1]["content"] == [{"type": "text", "text": "a"}, {"new": 0},
                                             {"type": "text", "text": "b"}, {"new": 1}]
    assert out["messages"][0] is body["messages"][0] and out["max_tokens"] == 4
    assert original_part(body, parts[1]) == {"type": "image_url", "image_url": {"url": PNG}}
    with pytest.raises(ValueError):
        rewrite(body, parts, [{}])


def test_pixel_bounds_come_from_mm_processor_kwargs():
    assert pixel_bounds({"mm_processor_kwargs": {"max_pixels": 1000, "min_pixels": 10, "fps": 2}}) == \
        {"max_pixels": 1000, "min_pixels": 10}
    assert pixel_bounds({"mm_processor_kwargs": {"max_pixels": True}}) == {}
    assert pixel_bounds({}) == {}
