# SPDX-License-Identifier: Apache-2.0
"""The splitter's pure half: routing keys, plans, and reassembly against the wire format."""

from __future__ import annotations

import base64
import json

import blake3
import pytest
import torch

from epd_encoder.api.parse import decode_encode_body
from epd_encoder.errors import SchemaError
from epd_encoder.router.split import Malformed, merge_inline, merge_json, plan, routing_key
from epd_encoder.types import ItemOutput
from epd_encoder.wire import ItemMeta, pack_inline, unpack_inline


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_routing_key_is_blake3_of_the_media_bytes_in_any_spelling():
    data = b"\x89PNG some image bytes"
    want = blake3.blake3(data).hexdigest()
    assert routing_key(b64(data)) == want
    assert routing_key("data:image/png;base64," + b64(data)) == want
    assert routing_key("https://example.com/a.png") == blake3.blake3(b"https://example.com/a.png").hexdigest()
    assert routing_key("not base64!") == blake3.blake3(b"not base64!").hexdigest()


def test_plan_splits_items_and_keeps_the_shared_fields():
    raw = json.dumps({"request_id": "r1", "items": [{"type": "image", "image": b64(b"a")},
                                                     {"type": "image_url", "image_url": {"url": "data:x;base64," + b64(b"b")}}],
                      "max_pixels": 5000, "delivery": {"mode": "pull"}, "unknown": 1}).encode()
    p = plan(raw, max_items=8)
    assert p is not None and p.mode == "pull" and p.request_id == "r1"
    assert p.keys == [blake3.blake3(b"a").hexdigest(), blake3.blake3(b"b").hexdigest()]
    subs = [json.loads(p.sub_body(i)) for i in range(2)]
    assert subs[0] == {"max_pixels": 5000, "delivery": {"mode": "pull"}, "request_id": "r1:0",
                       "items": [{"type": "image", "image": b64(b"a")}]}
    assert subs[1]["request_id"] == "r1:1"


def test_one_item_keeps_the_clients_request_id_and_a_long_one_stays_within_128():
    one = plan(json.dumps({"request_id": "x", "items": [{"type": "image", "image": "QQ=="}]}).encode(), max_items=8)
    assert one is not None and one.sub_id(0) == "x"
    long = "a" * 128
    many = plan(json.dumps({"request_id": long, "items": [{"type": "image", "image": "QQ=="}] * 3}).encode(),
                max_items=8)
    assert many is not None
    ids = {many.sub_id(i) for i in range(3)}
    assert len(ids) == 3 and all(len(i) <= 128 for i in ids)


def test_a_chat_body_becomes_items_in_order():
    raw = json.dumps({"messages": [
        {"role": "system", "content": "text only"},
        {"role": "user", "content": [{"type": "text", "text": "t"},
                                     {"type": "image_url", "image_url": "data:x;base64," + b64(b"1")},
                                     {"type": "video_url", "video_url": {"url": "data:v;base64," + b64(b"2")}}]},
    ]}).encode()
    p = plan(raw, max_items=8)
    assert p is not None
    assert p.items == [{"type": "image_url", "image_url": {"url": "data:x;base64," + b64(b"1")}},
                       {"type": "video_url", "video_url": {"url": "data:v;base64," + b64(b"2")}}]
    assert p.keys == [blake3.blake3(b"1").hexdigest(), blake3.blake3(b"2").hexdigest()]


@pytest.mark.parametrize("raw", [
    b"{not json", b"[]", b'{"items": [], "messages": []}', b"{}", b'{"items": []}',
    b'{"items": [{"type": "audio", "audio": "QQ=="}]}', b'{"items": [{"type": "image", "image": 3}]}',
    b'{"request_id": "bad id!", "items": [{"type": "image", "image": "QQ=="}]}',
    json.dumps({"items": [{"type": "image", "image": "QQ=="}] * 9}).encode(),
    # duplicate keys: a re-encoded sub-request would keep the last, hiding the 422 the server gives
    b'{"delivery": {"mode": "push"}, "delivery": {"mode": "inline"}, "items": [{"type": "image", "image": "QQ=="}]}',
    b'{"items": [{"type": "image", "image": "QQ==", "image": "Qg=="}]}',
])
def test_a_body_it_cannot_split_goes_whole_to_a_server(raw):
    assert plan(raw, max_items=8) is None


_PART = {"type": "image_url", "image_url": {"url": "data:x;base64,QQ=="}}


@pytest.mark.parametrize("messages", [
    [{"content": [_PART]}],  # no role
    [{"role": 5, "content": [_PART]}],
    [{"role": "user", "content": [_PART]}, {"role": "user", "content": 7}],
    [{"role": "user", "content": [{**_PART, "video": 5}]}],  # a field the sub-request would not carry
])
def test_a_chat_body_a_server_refuses_goes_whole_to_get_its_422(messages):
    raw = json.dumps({"messages": messages}).encode()
    with pytest.raises(SchemaError):
        decode_encode_body(raw, max_items=8)
    assert plan(raw, max_items=8) is None  # split, its items alone would be served (200)


def _inline(seed: int, deepstack: int, rid: str) -> tuple[bytes, ItemMeta, ItemOutput]:
    g = torch.Generator().manual_seed(seed)
    rows = 3 + seed
    output = ItemOutput(torch.randn(rows, 8, generator=g),
                        tuple(torch.randn(rows, 8, generator=g) for _ in range(deepstack)) or None)
    meta = ItemMeta.describe(output, key=f"{seed:064x}", grid_thw=(1, 2, 2 * rows), cache="miss")
    return pack_inline([(meta, output)], model="m", request_id=rid), meta, output


@pytest.mark.parametrize("deepstack", [0, 2])
def test_merged_inline_bodies_unpack_to_every_item_in_order(deepstack):
    parts = [_inline(seed, deepstack, f"r:{seed}") for seed in range(3)]
    info, items = unpack_inline(merge_inline([p[0] for p in parts], "r"))
    assert info == {"model": "m", "request_id": "r"}
    for (_, meta, output), (got_meta, got) in zip(parts, items):
        assert got_meta == meta
        assert torch.equal(got.embedding, output.embedding)
        for a, b in zip(got.deepstack or (), output.deepstack or ()):
            assert torch.equal(a, b)


def test_a_sub_answer_that_is_not_one_item_is_refused():
    two = pack_inline([(_inline(0, 0, "a")[1], _inline(0, 0, "a")[2])] * 2, model="m", request_id="a")
    with pytest.raises(Malformed):
        merge_inline([two], "r")
    with pytest.raises(Malformed):
        merge_inline([b"\x00" * 4], "r")
    with pytest.raises(Malformed):
        merge_json([b'{"items": []}'], [None], "r")


def test_merged_pull_answers_name_the_holding_server_in_each_url():
    subs = [json.dumps({"request_id": f"r:{i}", "model": "m",
                        "items": [{"key": str(i) * 64, "url": f"/v1/embeddings/{str(i) * 64}"}]}).encode()
            for i in range(2)]
    out = json.loads(merge_json(subs, ["MTI3LjAuMC4xOjkx+/==", None], "r"))
    assert out["request_id"] == "r" and out["model"] == "m"
    assert out["items"][0]["url"] == "/v1/embeddings/" + "0" * 64 + "?upstream=MTI3LjAuMC4xOjkx%2B%2F%3D%3D"
    assert out["items"][1]["url"] == "/v1/embeddings/" + "1" * 64
