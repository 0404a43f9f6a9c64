# SPDX-License-Identifier: Apache-2.0
"""The proxy's orchestration (epd_encoder.integrations.proxy_app) against fakes: the encode tier
and vLLM are httpx mock transports speaking their real wire formats; the encode client is the
real AsyncEncodeClient. Real vLLM behind the proxy is tests/integrations/test_proxy_vllm.py."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from dataclasses import replace

import httpx
import pytest
import torch

from epd_encoder.client import AsyncEncodeClient
from epd_encoder.config import ProxyConfig
from epd_encoder.integrations.proxy_app import create_proxy_app
from epd_encoder.integrations.proxy_upstream import LLMPool, Upstream
from epd_encoder.types import ItemOutput
from epd_encoder.wire import ItemMeta, pack_inline

PNG = "data:image/png;base64,iVBORw0KGgo="
LLM_A, LLM_B, TIER = "http://llm-a:8000", "http://llm-b:8000", "http://tier:8000"
SSE = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n',
       b"data: [DONE]\n\n"]


def key_of(url: str) -> str:
    return f"{abs(hash(url)):064x}"[-64:]


class Tier:
    """A fake encode tier: answers /v1/encode with one item per media item (inline wire
    format), or with ``fail`` (a status and error code) or an exception."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.fail: tuple[int, str] | Exception | None = None

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if isinstance(self.fail, Exception):
            raise self.fail
        if self.fail:
            status, code = self.fail
            return httpx.Response(status, json={"error": {"code": code, "message": "bad item 0"}})
        items = []
        for i, it in enumerate(body["items"]):
            url = it[it["type"]]["url"]
            out = ItemOutput(torch.full((6, 8), float(i)))
            items.append((ItemMeta.describe(out, key=key_of(url), grid_thw=(1, 4, 6), cache="miss"), out))
        if body["delivery"]["mode"] in ("pull", "ec_store"):  # kept at the tier / in the store: keys only
            return httpx.Response(200, json={"request_id": "r", "model": "m", "items": [
                {**meta.to_json(), "url": f"/v1/embeddings/{meta.key}"} for meta, _ in items]})
        return httpx.Response(200, content=pack_inline(items, model="m", request_id="r"),
                              headers={"content-type": "application/octet-stream"})


def streamed(status: int, obj: dict) -> httpx.Response:
    """A response whose body is read as it streams, as a real server's is (``json=`` would
    be read at construction)."""
    return httpx.Response(status, headers={"content-type": "application/json"},
                          stream=httpx.ByteStream(json.dumps(obj).encode()))


class VLLM:
    """A fake vLLM: records each request; chat streams SSE when asked, else JSON."""

    def __init__(self, name: str, refuse: bool = False) -> None:
        self.name, self.refuse, self.requests = name, refuse, []
        self.drop = False  # took the connection, then closed it without an answer

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.refuse:
            raise httpx.ConnectError("refused", request=request)
        if self.drop:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        self.requests.append(request)
        if request.url.path == "/v1/chat/completions":
            try:
                body = json.loads(request.content)
            except (ValueError, RecursionError):
                return streamed(400, {"error": {"message": "vllm cannot parse it", "type": "BadRequestError",
                                                "param": None, "code": 400}})
            if body.get("stream"):
                return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                      stream=httpx.ByteStream(b"".join(SSE)))
            return streamed(200, {"from": self.name, "choices": []})
        if request.url.path == "/v1/bad":
            return streamed(400, {"error": {"message": "vllm says no", "type": "BadRequestError",
                                            "param": None, "code": 400}})
        return streamed(200, {"from": self.name, "path": request.url.path, "query": request.url.query.decode()})


def route(servers: dict[str, VLLM]) -> httpx.MockTransport:
    return httpx.MockTransport(lambda r: servers[f"{r.url.scheme}://{r.url.host}:{r.url.port}"].handler(r))


class Rig:
    def __init__(self, n_llm: int = 1, **config) -> None:
        self.tier = Tier()
        self.llms = {url: VLLM(url) for url in (LLM_A, LLM_B)[:n_llm]}
        self.config = replace(ProxyConfig(encoder=TIER, llm=tuple(self.llms)), **config)
        encoder = AsyncEncodeClient(TIER, transport=httpx.MockTransport(self.tier.handler))
        self.pool = LLMPool(self.config.llm)
        self.app = create_proxy_app(self.config, encoder, Upstream(self.pool, httpx.AsyncClient(
            transport=route(self.llms))))

    def post(self, path: str, body, headers: dict | None = None) -> httpx.Response:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(self.app), base_url="http://proxy") as c:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                return await c.post(path, content=content,
                                    headers={"content-type": "application/json", **(headers or {})})
        return asyncio.run(go())

    def get(self, path: str) -> httpx.Response:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(self.app), base_url="http://proxy") as c:
                return await c.get(path)
        return asyncio.run(go())

    def sent(self, url: str = LLM_A) -> list[httpx.Request]:
        return self.llms[url].requests


def chat(*content, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(content)}], **extra}


def image(url=PNG) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_text_only_passes_straight_through_byte_for_byte():
    rig = Rig()
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}]}'  # odd spacing kept
    r = rig.post("/v1/chat/completions", raw, headers={"authorization": "Bearer user-key"})
    assert r.status_code == 200 and r.json()["from"] == LLM_A
    assert rig.tier.bodies == []
    (sent,) = rig.sent()
    assert sent.content == raw and sent.headers["authorization"] == "Bearer user-key"


def test_media_go_to_the_tier_and_vllm_gets_embeds_in_their_place():
    rig = Rig()
    body = chat({"type": "text", "text": "compare"}, image(), image("http://h/x.png"), max_tokens=3)
    r = rig.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    (encode,) = rig.tier.bodies
    assert encode["items"] == [image(), image("http://h/x.png")] and encode["delivery"] == {"mode": "inline"}
    sent = json.loads(rig.sent()[0].content)
    content = sent["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "compare"} and sent["max_tokens"] == 3
    for i, (part, url) in enumerate(zip(content[1:], (PNG, "http://h/x.png"))):
        assert part["type"] == "image_embeds" and part["uuid"] == key_of(url)
        rows = torch.load(io.BytesIO(base64.b64decode(part["image_embeds"]["image_embeds"])), weights_only=True)
        assert torch.equal(rows, torch.full((6, 8), float(i))) and part["image_embeds"]["image_grid_thw"] == [1, 4, 6]


def test_pixel_bounds_reach_the_tier():
    rig = Rig()
    rig.post("/v1/chat/completions", chat(image(), mm_processor_kwargs={"max_pixels": 50176}))
    assert rig.tier.bodies[0]["max_pixels"] == 50176


def test_a_stream_passes_through_unchanged():
    rig = Rig()
    r = rig.post("/v1/chat/completions", chat(image(), stream=True))
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    assert r.content == b"".join(SSE)
    assert rig.pool.outstanding == {LLM_A: 0}  # the slot came back when the stream ended


@pytest.mark.parametrize("status, code", [(400, "undecodable_image"), (413, "image_too_large"),
                                          (415, "unsupported_media"), (429, "overloaded")])
def test_the_tiers_4xx_is_the_clients_4xx_and_vllm_is_not_asked(status, code):
    rig = Rig()
    rig.tier.fail = (status, code)
    err = openai_error(rig.post("/v1/chat/completions", chat(image())), status)
    assert code in err["message"] and "bad item 0" in err["message"]
    assert rig.sent() == []


@pytest.mark.parametrize("fail", [httpx.ConnectError("down"), (503, "not_ready"), (500, "internal")])
def test_a_tier_outage_is_503(fail):
    rig = Rig()
    rig.tier.fail = fail
    openai_error(rig.post("/v1/chat/completions", chat(image())), 503)
    assert rig.sent() == []


def test_a_tier_outage_with_local_fallback_forwards_the_request_unchanged():
    rig = Rig(encoder_down="local")
    rig.tier.fail = httpx.ConnectError("down")
    raw = json.dumps(chat(image())).encode()
    assert rig.post("/v1/chat/completions", raw).status_code == 200
    assert rig.sent()[0].content == raw
    rig.tier.fail = (400, "undecodable_image")  # a bad image is still the client's error
    openai_error(rig.post("/v1/chat/completions", raw), 400)


def test_the_tier_timing_out_is_504():
    rig = Rig()
    rig.tier.fail = httpx.ReadTimeout("slow")
    openai_error(rig.post("/v1/chat/completions", chat(image())), 504)


def test_vllm_unreachable_is_503_and_a_refusing_server_is_skipped():
    rig = Rig(n_llm=2)
    rig.llms[LLM_A].refuse = True
    for _ in range(3):
        assert rig.post("/v1/chat/completions", chat(image())).json()["from"] == LLM_B
    rig.llms[LLM_B].refuse = True
    openai_error(rig.post("/v1/chat/completions", chat(image())), 503)
    assert rig.pool.outstanding == {LLM_A: 0, LLM_B: 0}


def test_vllm_dropping_the_connection_is_502_in_openais_shape():
    rig = Rig()
    rig.llms[LLM_A].drop = True
    openai_error(rig.post("/v1/chat/completions", chat(image())), 502)
    assert rig.pool.outstanding == {LLM_A: 0}


def test_a_body_nested_too_deep_to_parse_goes_to_vllm_as_it_is():
    rig = Rig()
    raw = b"[" * 100_000  # json.loads raises RecursionError, not ValueError
    r = rig.post("/v1/chat/completions", raw)
    assert r.status_code == 400 and r.json()["error"]["message"] == "vllm cannot parse it"
    assert rig.sent()[0].content == raw and rig.tier.bodies == []


def test_vllms_own_errors_come_back_as_they_are():
    rig = Rig()
    r = rig.post("/v1/bad", {})
    assert r.status_code == 400 and r.json()["error"]["message"] == "vllm says no"


def test_other_routes_pass_through():
    rig = Rig()
    r = rig.get("/v1/models?x=1")
    assert r.json() == {"from": LLM_A, "path": "/v1/models", "query": "x=1"}
    raw = b'{"model": "m", "prompt": "hello"}'
    assert rig.post("/v1/completions", raw).json()["path"] == "/v1/completions"
    assert rig.sent()[-1].content == raw and rig.tier.bodies == []


def test_an_oversized_body_is_413():
    rig = Rig(max_body_mb=1)
    openai_error(rig.post("/v1/chat/completions", chat(image("data:image/png;base64," + "A" * (1 << 20)))), 413)


def test_idle_servers_take_turns_and_a_busy_one_is_passed_over():
    pool = LLMPool([LLM_A, LLM_B])
    assert [pool.order()[0] for _ in range(4)] == [LLM_A, LLM_B, LLM_A, LLM_B]
    pool.outstanding[LLM_A] = 2
    assert [pool.order()[0] for _ in range(3)] == [LLM_B] * 3


@pytest.mark.parametrize("delivery", ["pull", "ec_store"])
def test_uuid_mode_keeps_the_items_at_the_tier_and_tags_each_part_with_its_key(delivery):
    rig = Rig(mode="uuid", uuid_delivery=delivery)
    parts = [{"type": "text", "text": "compare"}, image(), {**image("http://h/x.png"), "uuid": "theirs"}]
    assert rig.post("/v1/chat/completions", chat(*parts)).status_code == 200
    assert rig.tier.bodies[0]["delivery"] == {"mode": delivery}
    content = json.loads(rig.sent()[0].content)["messages"][0]["content"]
    assert content == [parts[0], {**image(), "uuid": key_of(PNG)},
                       {**image("http://h/x.png"), "uuid": key_of("http://h/x.png")}]  # the media stay


def test_a_large_body_is_parsed_and_rewritten_like_a_small_one():
    rig = Rig()
    big = "data:image/png;base64," + "A" * (200 << 10)  # past the size parsed on the event loop
    assert rig.post("/v1/chat/completions", chat(image(big))).status_code == 200
    assert rig.tier.bodies[0]["items"] == [image(big)]
    assert json.loads(rig.sent()[0].content)["messages"][0]["content"][0]["uuid"] == key_of(big)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_gone_mid_body_is_a_499_and_nothing_is_sent_on(path):
    rig = Rig()
    messages = [{"type": "http.request", "body": b'{"model": "m", "messages": [', "more_body": True}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
             "server": ("proxy", 80), "client": ("client", 1)}
    asyncio.run(rig.app(scope, receive, send))  # raised ClientDisconnect: a 500 and a logged traceback
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    assert rig.sent() == [] and rig.tier.bodies == []
