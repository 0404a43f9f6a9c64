# SPDX-License-Identifier: Apache-2.0
"""Inline and pull timing against a mock transport; push runs against a real server in test_cli."""

from __future__ import annotations

import asyncio
import json
import struct

import httpx
import pytest

from epd_encoder.bench.deliver import Inline, Pull, inline_cache_states, make_deliverer


def _safetensors(states):
    meta = {"__metadata__": {"format": "epd-encoder/v1",
                             "items": json.dumps([{"cache": s} for s in states])}}
    head = json.dumps(meta).encode()
    return struct.pack("<Q", len(head)) + head


def _call(deliver, handler):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as c:
            return await deliver(c, "r1", [{"type": "image", "image": "AA=="}], {})

    return asyncio.run(go())


def test_cache_states_from_the_inline_header_or_none_from_a_foreign_body():
    assert inline_cache_states(_safetensors(["hit", "miss"])) == ("hit", "miss")
    assert inline_cache_states(b"\x00" * 64) == ()
    assert inline_cache_states(b"") == ()


def test_inline_success_times_headers_then_body():
    seen = {}

    def handler(req):
        seen.update(json.loads(req.content))
        return httpx.Response(200, content=_safetensors(["coalesced"]))

    out = _call(Inline(), handler)
    assert out.ok and out.status == "200" and out.cache == ("coalesced",)
    assert 0 <= out.metadata_s <= out.embeddings_s
    assert seen["request_id"] == "r1" and seen["items"][0]["type"] == "image"


@pytest.mark.parametrize("deliver", [Inline(), Pull()])
def test_error_status_and_code_are_kept(deliver):
    out = _call(deliver, lambda req: httpx.Response(429, json={"error": {"code": "overloaded", "message": "x"}}))
    assert not out.ok and out.status == "429" and out.error == "overloaded" and out.embeddings_s is None


def test_a_foreign_error_body_is_kept_as_text():
    out = _call(Inline(), lambda req: httpx.Response(500, text="Internal Server Error"))
    assert out.status == "500" and out.error == "Internal Server Error"


def test_transport_failure_is_an_error_not_an_exception():
    def handler(req):
        raise httpx.ConnectError("refused")

    out = _call(Pull(), handler)
    assert out.status == "transport" and "refused" in out.error


def test_pull_fetches_every_item_before_the_embeddings_time():
    fetched = []

    def handler(req):
        if req.method == "POST":
            assert json.loads(req.content)["delivery"] == {"mode": "pull"}
            return httpx.Response(200, json={"items": [{"url": "/v1/embeddings/a", "cache": "hit"},
                                                       {"url": "/v1/embeddings/b", "cache": "miss"}]})
        fetched.append(req.url.path)
        return httpx.Response(200 if req.url.path.endswith("a") else 404, content=b"x")

    out = _call(Pull(), handler)
    assert sorted(fetched) == ["/v1/embeddings/a", "/v1/embeddings/b"]
    assert out.status == "404" and not out.ok  # one expired item fails the request

    fetched.clear()
    ok = _call(Pull(), lambda req: handler(req) if req.method == "POST" else httpx.Response(200, content=b"x"))
    assert ok.ok and ok.cache == ("hit", "miss") and ok.metadata_s <= ok.embeddings_s


def test_push_needs_a_receiver_and_modes_are_checked():
    with pytest.raises(ValueError, match="receiver"):
        make_deliverer("push")
    with pytest.raises(ValueError, match="unknown"):
        make_deliverer("carrier-pigeon")
