# SPDX-License-Identifier: Apache-2.0
import asyncio
import base64
import io
import json

import httpx
import pytest
import torch
from PIL import Image

from epd_encoder import errors
from epd_encoder.client import AsyncEncodeClient, EncodeClient
from epd_encoder.errors import (
    EncoderError,
    NotFound,
    NotReady,
    RequestTimeout,
    SchemaError,
    Unauthorized,
)
from epd_encoder.types import ItemOutput
from epd_encoder.wire import ItemMeta, pack_inline, pack_item

BASE = "http://encoder.test"


def item(i: int, n_ds: int = 0, cache: str = "miss"):
    g = torch.Generator().manual_seed(i)
    out = ItemOutput(torch.randn(4, 6, generator=g).to(torch.bfloat16),
                     tuple(torch.randn(4, 6, generator=g).to(torch.bfloat16) for _ in range(n_ds)) or None)
    return ItemMeta.describe(out, key=f"{i:064x}", grid_thw=(1, 4, 4), cache=cache), out


class FakeServer:
    """Canned responses per (method, path); records every request it sees."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], object] = {}
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        reply = self.routes[(request.method, request.url.path)]
        if isinstance(reply, Exception):
            raise reply
        # A fresh response each time: httpx binds a response's stream to the client that read it.
        return httpx.Response(reply.status_code, headers=reply.headers, content=reply.content)

    def body(self, n: int = -1) -> dict:
        return json.loads(self.seen[n].content)


class AsyncDriver:
    """Runs AsyncEncodeClient's coroutines to completion so tests can share code."""

    def __init__(self, client: AsyncEncodeClient) -> None:
        self._client, self._loop = client, asyncio.new_event_loop()

    def __getattr__(self, name):
        fn = getattr(self._client, name)
        return lambda *a, **kw: self._loop.run_until_complete(fn(*a, **kw))

    def shutdown(self) -> None:
        self._loop.run_until_complete(self._client.close())
        self._loop.close()


@pytest.fixture(params=["sync", "async"])
def make_client(request):
    made = []

    def make(server: FakeServer, **kw):
        transport = httpx.MockTransport(server)
        if request.param == "sync":
            c = EncodeClient(BASE, transport=transport, **kw)
            made.append(c.close)
            return c
        d = AsyncDriver(AsyncEncodeClient(BASE, transport=transport, **kw))
        made.append(d.shutdown)
        return d

    yield make
    for close in made:
        close()


def inline_reply(items, rid="rid-1", model="org/m"):
    return httpx.Response(200, content=pack_inline(items, model=model, request_id=rid),
                          headers={"content-type": "application/octet-stream"})


def png_bytes(color=(10, 20, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (5, 3), color).save(buf, "PNG")
    return buf.getvalue()


def test_encode_builds_the_documented_body_for_every_input_kind(make_client, tmp_path):
    server = FakeServer()
    items = [item(i) for i in range(6)]
    server.routes[("POST", "/v1/encode")] = inline_reply(items)
    raw, path_bytes = png_bytes(), png_bytes((1, 2, 3))
    (tmp_path / "a.png").write_bytes(path_bytes)
    pil = Image.new("RGB", (4, 4), (200, 100, 0))
    data_url = "data:image/png;base64," + base64.b64encode(raw).decode()
    client = make_client(server)
    client.encode([raw, str(tmp_path / "a.png"), tmp_path / "a.png", pil, data_url, "https://x.test/i.jpg"],
                  request_id="abc", max_pixels=50176)
    body = server.body()
    assert body["request_id"] == "abc" and body["max_pixels"] == 50176 and "min_pixels" not in body
    assert body["delivery"] == {"mode": "inline"}
    sent = body["items"]
    assert [s["type"] for s in sent] == ["image"] * 4 + ["image_url"] * 2
    assert base64.b64decode(sent[0]["image"]) == raw
    assert base64.b64decode(sent[1]["image"]) == path_bytes == base64.b64decode(sent[2]["image"])
    decoded = Image.open(io.BytesIO(base64.b64decode(sent[3]["image"])))
    assert decoded.format == "PNG" and decoded.getpixel((2, 2)) == (200, 100, 0)
    assert sent[4] == {"type": "image_url", "image_url": {"url": data_url}}
    assert sent[5] == {"type": "image_url", "image_url": {"url": "https://x.test/i.jpg"}}
    assert server.seen[-1].headers["content-type"] == "application/json"


def test_inline_result_carries_tensors_and_metadata(make_client):
    server = FakeServer()
    items = [item(0, n_ds=2, cache="hit"), item(1, cache="coalesced")]
    server.routes[("POST", "/v1/encode")] = inline_reply(items, rid="r-9", model="Qwen/X")
    res = make_client(server).encode([b"a", b"b"])
    assert (res.request_id, res.model, len(res.items)) == ("r-9", "Qwen/X", 2)
    for got, (meta, out) in zip(res.items, items):
        assert got.key == meta.key and got.num_tokens == 4 and got.grid_thw == (1, 4, 4)
        assert got.cache == meta.cache
        assert torch.equal(got.embedding, out.embedding)
    assert len(res.items[0].deepstack) == 2 and torch.equal(res.items[0].deepstack[1], items[0][1].deepstack[1])
    assert res.items[1].deepstack is None


def test_bearer_token_is_sent_only_when_configured(make_client):
    server = FakeServer()
    server.routes[("GET", "/v1/models")] = httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
    assert make_client(server, api_key="s3cret").models() == [{"id": "m"}]
    assert server.seen[-1].headers["authorization"] == "Bearer s3cret"
    make_client(server).models()
    assert "authorization" not in server.seen[-1].headers


def test_pull_returns_metadata_then_fetch_gets_tensors(make_client):
    server = FakeServer()
    items = [item(0, n_ds=1), item(1)]
    listing = {"request_id": "p1", "model": "org/m",
               "items": [{**m.to_json(), "cache": "hit", "url": f"/v1/embeddings/{m.key}"} for m, _ in items]}
    server.routes[("POST", "/v1/encode")] = httpx.Response(200, json=listing)
    for m, o in items:
        server.routes[("GET", f"/v1/embeddings/{m.key}")] = httpx.Response(200, content=pack_item(m, o, model="org/m"))
    client = make_client(server)

    res = client.encode([b"x", b"y"], delivery="pull")
    assert server.body()["delivery"] == {"mode": "pull"} and len(server.seen) == 1
    assert [it.embedding for it in res.items] == [None, None]
    assert [it.key for it in res.items] == [m.key for m, _ in items] and res.items[0].cache == "hit"

    got = client.fetch(items[1][0].key)
    assert torch.equal(got.embedding, items[1][1].embedding) and got.cache == "miss"

    res = client.encode([b"x", b"y"], delivery="pull", fetch=True)
    fetched_paths = sorted(r.url.path for r in server.seen[-2:])
    assert fetched_paths == sorted(f"/v1/embeddings/{m.key}" for m, _ in items)
    assert torch.equal(res.items[0].deepstack[0], items[0][1].deepstack[0])
    assert [it.cache for it in res.items] == ["hit", "hit"]  # this request's state, not the stored one


def test_push_answer_with_a_cached_item_parses(make_client):
    # A hit's 202 item names its tier (device/host/shared); it was refused as a tier on a miss.
    server = FakeServer()
    (hit, _), (pending, _) = item(0), item(1)
    answer = {"request_id": "r1", "model": "org/m", "room": "room-1",
              "items": [{**hit.to_json(), "cache": "hit", "tier": "device"}, {**pending.to_json(), "cache": "pending"}]}
    server.routes[("POST", "/v1/encode")] = httpx.Response(202, json=answer)
    delivery = {"mode": "push", "backend": "tcp", "room": "room-1",
                "targets": [{"endpoint": "tcp://127.0.0.1:1", "rank": 0}]}
    res = make_client(server).encode([b"x", b"y"], delivery=delivery)
    assert [(it.key, it.cache, it.embedding) for it in res.items] == [(hit.key, "hit", None), (pending.key, "pending", None)]


def test_encode_chat_posts_the_messages(make_client):
    server = FakeServer()
    server.routes[("POST", "/v1/encode")] = inline_reply([item(0)])
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    res = make_client(server).encode_chat(messages, min_pixels=3136)
    assert server.body() == {"messages": messages, "min_pixels": 3136, "delivery": {"mode": "inline"}}
    assert len(res.items) == 1


def _all_error_classes():
    out, todo = [], [EncoderError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_error_body_raises_the_class_named_by_its_code(cls):
    server = FakeServer()
    server.routes[("POST", "/v1/encode")] = httpx.Response(
        418, json={"error": {"code": cls.code, "message": f"msg for {cls.code}"}})
    with EncodeClient(BASE, transport=httpx.MockTransport(server)) as client, pytest.raises(EncoderError) as info:
        client.encode([b"x"])
    assert type(info.value) is cls
    assert info.value.message == f"msg for {cls.code}" and info.value.status == 418


@pytest.mark.parametrize(
    "reply, cls",
    [
        (httpx.Response(422, json={"error": {"code": "brand_new_code", "message": "m"}}), EncoderError),
        (httpx.Response(500, text="<html>proxy error</html>"), EncoderError),
        (httpx.Response(502, json={"detail": "not our shape"}), EncoderError),
        (httpx.Response(401, text=""), Unauthorized),
        (httpx.Response(404, json={"detail": "Not Found"}), NotFound),
        (httpx.Response(429, json={"error": {"code": "overloaded", "message": "busy"}}), errors.Overloaded),
    ],
)
def test_error_fallbacks(make_client, reply, cls):
    server = FakeServer()
    server.routes[("GET", "/v1/embeddings/" + "0" * 64)] = reply
    with pytest.raises(EncoderError) as info:
        make_client(server).fetch("0" * 64)
    assert type(info.value) is cls and info.value.status == reply.status_code


@pytest.mark.parametrize(
    "exc, cls",
    [(httpx.ConnectError("refused"), NotReady), (httpx.ReadTimeout("slow"), RequestTimeout),
     (httpx.ConnectTimeout("slow"), RequestTimeout), (httpx.RemoteProtocolError("eof"), NotReady)],
)
def test_transport_failures_are_typed_and_chained(make_client, exc, cls):
    server = FakeServer()
    server.routes[("POST", "/v1/encode")] = exc
    with pytest.raises(cls) as info:
        make_client(server).encode([b"x"])
    assert info.value.__cause__ is exc


def test_health(make_client):
    server = FakeServer()
    client = make_client(server)
    for reply, want in ((httpx.Response(200, json={"status": "ok"}), True),
                        (httpx.Response(503, json={"error": {"code": "not_ready", "message": "warming"}}), False),
                        (httpx.ConnectError("refused"), False)):
        server.routes[("GET", "/health")] = reply
        assert client.health() is want
    server.routes[("GET", "/health")] = httpx.Response(401, json={"error": {"code": "unauthorized", "message": "no"}})
    with pytest.raises(Unauthorized):
        client.health()


def test_malformed_success_bodies_raise_schema_error(make_client):
    server = FakeServer()
    client = make_client(server)
    server.routes[("POST", "/v1/encode")] = httpx.Response(200, content=b"not safetensors")
    with pytest.raises(SchemaError):
        client.encode([b"x"])
    server.routes[("POST", "/v1/encode")] = httpx.Response(200, json={"request_id": "r"})
    with pytest.raises(SchemaError):
        client.encode([b"x"], delivery="pull")
    server.routes[("GET", "/v1/models")] = httpx.Response(200, json={"object": "list"})
    with pytest.raises(SchemaError):
        client.models()


def test_bad_arguments_fail_before_sending(make_client):
    server = FakeServer()
    client = make_client(server)
    with pytest.raises(TypeError):
        client.encode([12345])
    with pytest.raises(ValueError):
        client.encode([b"x"], delivery="push")
    assert server.seen == []


def test_context_managers_close_the_http_client():
    transport = httpx.MockTransport(FakeServer())
    with EncodeClient(BASE, transport=transport) as c:
        pass
    assert c._http.is_closed

    async def run():
        async with AsyncEncodeClient(BASE, transport=transport) as ac:
            pass
        return ac

    assert asyncio.run(run())._http.is_closed


def test_arrays_and_tensors_are_sent_as_png_of_their_pixels(make_client):
    import numpy as np

    server = FakeServer()
    server.routes[("POST", "/v1/encode")] = inline_reply([item(i) for i in range(4)])
    rng = np.random.default_rng(3)
    hwc = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    gray = rng.integers(0, 256, (4, 7), dtype=np.uint8)
    make_client(server).encode([hwc, torch.from_numpy(hwc.copy()), gray, hwc[:, :, :1]])
    sent = [Image.open(io.BytesIO(base64.b64decode(s["image"]))) for s in server.body()["items"]]
    assert [im.format for im in sent] == ["PNG"] * 4
    assert np.array_equal(np.asarray(sent[0]), hwc) and np.array_equal(np.asarray(sent[1]), hwc)
    assert np.array_equal(np.asarray(sent[2]), gray) and np.array_equal(np.asarray(sent[3]), hwc[:, :, 0])
    # The PNG re-encode is byte-identical for equal pixels: an array and its tensor share a content key.
    assert server.body()["items"][0] == server.body()["items"][1]


@pytest.mark.parametrize("bad", ["float", "chw", "bf16"])
def test_arrays_of_the_wrong_layout_or_dtype_are_refused_clearly(make_client, bad):
    import numpy as np

    server = FakeServer()
    arr = {"float": np.zeros((4, 4, 3), np.float32), "chw": torch.zeros(3, 8, 8, dtype=torch.uint8),
           "bf16": torch.zeros(8, 8, 3, dtype=torch.bfloat16)}[bad]
    with pytest.raises(ValueError, match=r"uint8 \[H, W\] or \[H, W, C\]"):
        make_client(server).encode([arr])
    assert server.seen == []


def test_raw_base64_text_is_refused_with_a_clear_message(make_client, tmp_path):
    server = FakeServer()
    client = make_client(server)
    big = base64.b64encode(png_bytes() * 2000).decode()  # far beyond the file-name length limit
    with pytest.raises(ValueError, match="looks like raw base64.*b64decode"):
        client.encode([big])
    with pytest.raises(ValueError, match="looks like raw base64"):
        client.encode([base64.b64encode(png_bytes()).decode()])
    with pytest.raises(FileNotFoundError, match="no such image file"):
        client.encode([str(tmp_path / "missing.png")])
    assert server.seen == []


def test_importing_the_client_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, epd_encoder.client, epd_encoder.wire; "
            "from epd_encoder import EncodeClient, AsyncEncodeClient; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'numpy' not in sys.modules, 'numpy imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_package_exports_the_clients_and_receiver_lazily():
    import epd_encoder
    from epd_encoder.receiver import EmbeddingReceiver as R

    from epd_encoder import AsyncEncodeClient as A, EmbeddingReceiver, EncodeClient as E
    assert (E, A, EmbeddingReceiver) == (EncodeClient, AsyncEncodeClient, R)
    assert {"EncodeClient", "AsyncEncodeClient", "EmbeddingReceiver"} <= set(epd_encoder.__all__)
