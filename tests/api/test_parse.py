# SPDX-License-Identifier: Apache-2.0
"""The /v1/encode body decoder: caps hit while decoding, pydantic only on capped input."""

from __future__ import annotations

import json
import re
import time

import pytest

from epd_encoder.api import parse
from epd_encoder.api.parse import decode_encode_body, request_doc
from epd_encoder.api.schemas import EncodeBody, ImageItem
from epd_encoder.errors import SchemaError, TooLarge, TooManyItems


def decode(obj, max_items: int = 4) -> EncodeBody:
    return decode_encode_body(json.dumps(obj).encode(), max_items=max_items)


def test_a_valid_body_is_the_pydantic_model():
    body = decode({"request_id": "r1", "items": [{"type": "image", "image": "AA==", "extra": [1]}],
                   "max_pixels": 1000, "unknown": {"deep": [[[]]]}})
    assert isinstance(body, EncodeBody) and body.request_id == "r1" and body.max_pixels == 1000
    assert isinstance(body.items[0], ImageItem) and body.sources() == [("image", "b64", "AA==")]
    chat = decode({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:x"}},
        {"type": "image_url", "image_url": "data:y"}]}]})
    assert chat.sources() == [("image", "url", "data:x"), ("image", "url", "data:y")]


def test_video_items_and_chat_parts_become_video_sources_in_order():
    body = decode({"items": [{"type": "video", "video": "AAAA"}, {"type": "image", "image": "AA=="},
                             {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}],
                   "video_options": {"fps": 1.5, "max_frames": 8}})
    assert body.sources() == [("video", "b64", "AAAA"), ("image", "b64", "AA=="),
                              ("video", "url", "data:video/mp4;base64,AA==")]
    assert body.video_options.fps == 1.5 and body.video_options.max_frames == 8
    assert body.video_options.min_frames is None
    chat = decode({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, {"type": "text", "text": "?"},
        {"type": "video_url", "video_url": "data:v"}, {"type": "video", "video": "AA=="}]}]})
    assert chat.sources() == [("video", "url", "https://x/v.mp4"), ("video", "url", "data:v"),
                              ("video", "b64", "AA==")]


@pytest.mark.parametrize("options", [{"fps": 0}, {"fps": -1}, {"max_frames": 0}, {"max_frames": 1.5},
                                     {"frames": 4}, {"fps": "fast"}])
def test_bad_video_options_are_a_schema_error(options):
    with pytest.raises(SchemaError):
        decode({"items": [{"type": "video", "video": "AA=="}], "video_options": options})


def test_a_malformed_video_item_is_a_schema_error_not_an_unsupported_type():
    with pytest.raises(SchemaError):
        decode({"items": [{"type": "video", "url": "AA=="}]})


def test_items_over_the_cap_stop_the_decode_at_the_first_one_over():
    raw = b'{"items":[' + b",".join([b'{"type":"image","image":""}'] * 100_000) + b"]}"
    with pytest.raises(TooManyItems, match="at most 4"):
        decode_encode_body(raw, max_items=4)
    assert parse._caps.counts == {"items": 5}  # this thread's counts of the decode that just stopped


@pytest.mark.parametrize("obj,error", [
    ({"messages": [{"role": "u", "content": [{"type": "image", "image": "A"}] * 5}]}, TooManyItems),
    ({"messages": [{"role": "u", "content": [{"type": "text", "text": "t"}] * (parse.MAX_PARTS + 1)}]}, TooLarge),
    ({"messages": [{"role": "u", "content": "t"}] * (parse.MAX_MESSAGES + 1)}, TooLarge),
])
def test_chat_bodies_are_capped(obj, error):
    with pytest.raises(error):
        decode(obj)


def test_the_caps_hold_for_one_decode_only():
    for _ in range(3):  # counts never carry over from one body to the next
        assert len(decode({"items": [{"type": "image", "image": "A"}] * 4}).items) == 4


@pytest.mark.parametrize("raw", [b"", b"{not json", b"[1]", b'{"items": 5}', b'{"items":[1,2]}', b'{"itemz":[]}',
                                 b'{"items":[{"type":"image"}]}', b'{"items":[], "request_id":"bad id"}',
                                 b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                 b'{"items":[{"type":"image","image":"A"}],"delivery":{"mode":"nope"}}'])
def test_malformed_bodies_are_one_short_schema_error(raw):
    with pytest.raises(SchemaError) as e:
        decode_encode_body(raw, max_items=4)
    assert 0 < len(e.value.message) < 300


def test_a_million_bad_elements_make_one_error_quickly():
    raw = b'{"items":[' + b",".join([b"1"] * 1_000_000) + b"]}"
    t0 = time.perf_counter()
    with pytest.raises(SchemaError, match=r"^items\.0: "):
        decode_encode_body(raw, max_items=64)
    assert time.perf_counter() - t0 < 0.5


def test_push_delivery_keeps_the_shared_rule():
    target = {"endpoint": "tcp://127.0.0.1:5555", "rank": 0, "info": {"k": [1, 2]}}
    ok = {"mode": "push", "backend": "tcp", "room": 2**64, "targets": [target]}
    body = decode({"items": [{"type": "image", "image": "A"}], "delivery": ok})
    assert body.delivery.room == str(2**64) and body.delivery.targets[0].info == {"k": [1, 2]}
    for bad in ({**ok, "room": "a b"}, {**ok, "targets": [target] * 2}, {**ok, "bootstrap_timeout": 0},
                {**ok, "targets": [{**target, "rank": i, "endpoint": f"tcp://h:{i + 1}"} for i in range(65)]},
                {**ok, "targets": [{**target, "info": {"x": "y" * parse.MAX_INFO_BYTES}}]}):
        with pytest.raises(SchemaError):
            decode({"items": [{"type": "image", "image": "A"}], "delivery": bad})


def test_the_request_doc_is_the_encode_body_schema_and_its_refs_resolve():
    doc = request_doc()
    schema = doc["requestBody"]["content"]["application/json"]["schema"]
    assert {"items", "messages", "delivery", "request_id"} <= set(schema["properties"])
    refs = [v for v in _walk(schema) if isinstance(v, str) and v.startswith("#/")]
    assert refs
    for ref in refs:  # each points into this schema's own $defs, at its place in /openapi.json
        prefix = "#/paths/~1v1~1encode/post/requestBody/content/application~1json/schema/$defs/"
        assert ref.startswith(prefix) and ref[len(prefix):] in schema["$defs"]


def _walk(node):
    if isinstance(node, dict):
        for v in node.values():
            yield v
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


@pytest.mark.parametrize("where,value", [
    ("video_options.fps", "2"), ("video_options.fps", True), ("video_options.min_frames", "4"),
    ("video_options.max_frames", True), ("video_options.max_frames", 768.0), ("video_options.min_pixels", "3136"),
    ("video_options.max_pixels", 3136.0), ("min_pixels", "3136"), ("min_pixels", True), ("max_pixels", "1003520"),
    ("max_pixels", 1003520.0),
])
def test_numbers_are_strictly_typed_never_converted(where, value):
    # pydantic's lax mode made "2" and true the number 2 and 1: strict types, a 422 naming the field.
    obj: dict = {"items": [{"type": "video", "video": "AA=="}]}
    *parents, name = where.split(".")
    node = obj
    for parent in parents:
        node = node.setdefault(parent, {})
    node[name] = value
    with pytest.raises(SchemaError, match=rf"^{re.escape(where)}: ") as e:
        decode(obj)
    assert "not valid JSON" not in str(e.value)


def test_a_float_fps_and_int_pixel_bounds_are_accepted():
    body = decode({"items": [{"type": "video", "video": "AA=="}], "min_pixels": 3136,
                   "video_options": {"fps": 2, "max_frames": 768, "max_pixels": 200704}})
    assert body.video_options.fps == 2.0 and body.video_options.max_frames == 768 and body.min_pixels == 3136


@pytest.mark.parametrize("field,value", [("rank", "1"), ("rank", True)])
def test_push_target_numbers_are_strict_too(field, value):
    target = {"endpoint": "127.0.0.1:5000", field: value}
    with pytest.raises(SchemaError, match=r"^delivery\.targets\.0\.rank: "):
        decode({"items": [{"type": "image", "image": "AA=="}],
                "delivery": {"mode": "push", "backend": "tcp", "room": "r", "targets": [target]}})


@pytest.mark.parametrize("raw", [
    b'{"items":[{"type":"image","image":"AA=="}],"delivery":{"mode":"push"},"delivery":{"mode":"inline"}}',
    b'{"items":[{"type":"image","image":"AA=="}],"delivery":{"mode":"inline","mode":"inline"}}',
    b'{"items":[{"type":"image","image":"AA==","image":"AB=="}]}',
    b'{"items":[{"type":"image","image":"AA=="}],"items":[{"type":"image","image":"AB=="}]}',
    b'{"items":[{"type":"image","image":"AA=="}],"unknown":[{"deep":{"k":1,"k":2}}]}',
    b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a","url":"b"}}]}]}',
])
def test_a_duplicate_key_at_any_depth_is_a_schema_error(raw):
    # Last-wins would let a gateway that reads the first key see another request than we serve.
    with pytest.raises(SchemaError, match="duplicate key"):
        decode_encode_body(raw, max_items=4)


def test_equal_keys_in_sibling_objects_are_not_duplicates():
    raw = b'{"items":[{"type":"image","image":"AA=="},{"type":"image","image":"AB=="}],"x":{"type":1}}'
    assert len(decode_encode_body(raw, max_items=4).items) == 2


def test_the_duplicate_key_check_builds_a_bounded_number_of_values():
    # It parses with the stdlib, which builds what msgspec skips: [] is 3 bytes of body, ~60 of heap.
    junk = b'{"items":[{"type":"image","image":"AA=="}],"x":[' + b",".join([b"[]"] * parse.MAX_JSON_VALUES) + b"]}"
    with pytest.raises(TooLarge, match="JSON values"):
        decode_encode_body(junk, max_items=4)


def test_commas_inside_strings_do_not_count_as_json_values():
    prose = "a, " * (parse.MAX_JSON_VALUES + 1)
    body = decode({"messages": [{"role": "user", "content": [{"type": "text", "text": prose}]}]})
    assert body.sources() == []


@pytest.mark.parametrize("escape", ["", "\\n", '\\"', "\\\\"], ids=["plain", "newline", "quote", "backslash"])
def test_duplicate_keys_are_found_beside_long_strings_with_or_without_escapes(escape):
    # Long string values are cut from what the check parses unless an escape is present: both paths.
    image = "A" * 1000 + escape
    dup = '{"items":[{"type":"image","image":"%s"}],"delivery":{"mode":"push"},"delivery":{"mode":"inline"}}'
    with pytest.raises(SchemaError, match="duplicate key 'delivery'"):
        decode_encode_body((dup % image).encode(), max_items=4)
    long_keys = '{"items":[{"type":"image","image":"%s"}],"%s":1,"%s":2}' % (image, "k" * 100, "k" * 99 + "j")
    assert len(decode_encode_body(long_keys.encode(), max_items=4).items) == 1
    with pytest.raises(SchemaError, match="duplicate key"):
        decode_encode_body(('{"items":[{"type":"image","image":"%s"}],"%s":1,"%s":2}'
                            % (image, "k" * 100, "k" * 100)).encode(), max_items=4)


@pytest.mark.parametrize("tail,accepted", [(b'"\xff\xfe"', False), (b"9" * 5000, True), (b"1e999", True)])
def test_the_duplicate_key_check_raises_only_typed_errors(tail, accepted):
    # The stdlib parser reads fields msgspec skipped: invalid UTF-8 there is a 422, not a 500,
    # and a number Python would not convert (over 4300 digits) is valid JSON, left as it is.
    raw = b'{"items":[{"type":"image","image":"AA=="}],"x":' + tail + b"}"
    if accepted:
        assert len(decode_encode_body(raw, max_items=4).items) == 1
    else:
        with pytest.raises(SchemaError, match="not valid JSON"):
            decode_encode_body(raw, max_items=4)
