# SPDX-License-Identifier: Apache-2.0
"""Our SGLang encoder protocol against SGLang 0.5.23's own receive code (docs/integrations.md).

A real server of ours (``--sglang-encoder``) on loopback; SGLang's prefill-side code from the
wheel (tests/integrations/sglang_prefill.py, in a subprocess: its import stubs CUDA-only
modules) builds the ``/encode`` request, receives and unpickles our parts with its
allowlisted ``safe_pickle_loads`` and aggregates them. What it assembles must equal our
inline embeddings for the same images, bit for bit.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import zmq
from safetensors.torch import load_file

from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, png, serve_config
from tests.integrations.sglang_wheel import sglang_tree

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory):
    from epd_encoder.models.tiny import write_tiny_model

    tiny = write_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "qwen2_5_vl")
    s = Server(serve_config(tiny, sglang_encoder=True)).start()
    yield s
    s.stop()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _inline(server: Server, urls: list[str]) -> tuple[torch.Tensor, list[list[int]]]:
    """Our inline rows for ``urls``, deepstack concatenated on the hidden axis, and the grids."""
    body = {"items": [{"type": "image_url", "image_url": {"url": u}} for u in urls]}
    r = httpx.post(f"{server.url}/v1/encode", json=body, timeout=60)
    r.raise_for_status()
    _, items = unpack_inline(r.content)
    rows = [torch.cat([o.embedding, *(o.deepstack or ())], dim=-1) for _, o in items]
    return torch.cat(rows), [list(m.grid_thw) for m, _ in items]


def _error_part(server: Server) -> bytes:
    """What an undecodable image makes us push to a zmq_to_tokenizer port (one frame)."""
    pull = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        r = httpx.post(f"{server.url}/encode", timeout=60,
                       json={"req_id": "bad_local_part_0", "modality": "IMAGE", "num_parts": 1, "part_idx": 0,
                             "mm_items": ["data:image/png;base64,AAAA"], "prefill_host": "127.0.0.1",
                             "embedding_port": port})
        assert r.status_code == 415, r.text
        assert pull.poll(30_000), "no error part pushed"
        frames = pull.recv_multipart()
        assert len(frames) == 1
        return frames[0]
    finally:
        pull.close(linger=0)


def test_sglang_receiver_takes_our_embeddings(sglang_server, tmp_path):
    """Also: SGLang's allowlisted unpickler reads our error part (not an image: 415)."""
    sglang_dir, deps = sglang_tree()
    urls = [_data_url(png(1)), _data_url(png(2, size=(64, 96)))]
    out, error = tmp_path / "received.safetensors", tmp_path / "error.pickle"
    error.write_bytes(_error_part(sglang_server))
    proc = subprocess.run([sys.executable, str(HERE / "sglang_prefill.py"), str(sglang_dir), str(deps),
                           sglang_server.url, str(out), str(error), *urls],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ERROR_PART 415 " in proc.stdout, proc.stdout
    got = load_file(out)
    want, grids = _inline(sglang_server, urls)
    assert got["img_grid_thw"].tolist() == grids
    assert got["embedding"].dtype == want.dtype
    assert torch.equal(got["embedding"], want)


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    from epd_encoder.models.tiny import write_tiny_model

    tiny = write_tiny_model("qwen3_vl", tmp_path_factory.mktemp("tiny") / "qwen3_vl")
    s = Server(serve_config(tiny, sglang_encoder=True)).start()
    yield s
    s.stop()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_scheduler_receive_url_then_encode_pushes_to_the_registered_url(family, request):
    """zmq_to_scheduler: the rank registers its URL, /encode carries no port (our frames, raw).
    Qwen3-VL's rows carry its deepstack tensors after the embedding, as SGLang's encoder sends."""
    sglang_server = request.getfixturevalue("sglang_server" if family == "qwen2_5_vl" else "qwen3_server")
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        url = _data_url(png(3))
        rid = "abc_local_part_0"
        r = httpx.post(f"{sglang_server.url}/scheduler_receive_url", timeout=30,
                       json={"req_id": rid, "receive_count": 1, "receive_url": f"127.0.0.1:{port}",
                             "modality": "IMAGE"})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{sglang_server.url}/encode", timeout=60,
                       json={"req_id": rid, "modality": "IMAGE", "mm_items": [url], "num_parts": 1,
                             "part_idx": 0, "prefill_host": "127.0.0.1", "embedding_port": None})
        assert r.status_code == 200, r.text
        assert pull.poll(30_000), "nothing pushed to the registered URL"
        frames = pull.recv_multipart()
        want, _ = _inline(sglang_server, [url])
        assert len(frames) == 2
        got = torch.frombuffer(bytearray(frames[1]), dtype=want.dtype).reshape(want.shape)
        assert torch.equal(got, want)
        if family == "qwen3_vl":
            info = httpx.get(f"{sglang_server.url}/v1/models", timeout=30).json()["data"][0]
            assert info["num_deepstack"] > 0 and want.shape[1] == info["hidden_size"] * (1 + info["num_deepstack"])
    finally:
        pull.close(linger=0)


def test_mooncake_routes_answer_501(sglang_server):
    r = httpx.post(f"{sglang_server.url}/send", json={"req_id": "x"}, timeout=30)
    assert r.status_code == 501 and "zmq_to_scheduler" in r.json()["message"]


def test_bad_part_index_is_a_schema_error(sglang_server):
    r = httpx.post(f"{sglang_server.url}/encode", timeout=30,
                   json={"req_id": "r_local_part_0", "modality": "IMAGE", "mm_items": ["data:x"],
                         "num_parts": 1, "part_idx": 1, "prefill_host": "127.0.0.1", "embedding_port": 5})
    assert r.status_code == 422


def test_without_the_flag_there_is_no_sglang_route(tmp_path):
    from epd_encoder.api.app import create_app

    app = create_app(serve_config(tmp_path), lambda c, m: None)
    assert "/encode" not in {getattr(r, "path", None) for r in app.routes}


class _StalledPusher:
    """A push whose tracker times out: ``MessageTracker.wait`` raises ``zmq.NotDone``, which is
    not a ``zmq.ZMQError`` (the prefill's socket took the connection but not the message)."""

    send_timeout = 0.01

    def send(self, endpoint: str, frames: list) -> None:
        raise zmq.NotDone


def _protocol_app(encode):
    """The protocol's routes over a fake runtime whose ``front.encode`` is ``encode``."""
    from types import SimpleNamespace

    from fastapi import FastAPI

    from epd_encoder.api import errors as api_errors
    from epd_encoder.integrations.sglang_encoder import add_sglang_routes

    app = FastAPI()
    api_errors.install(app)
    rt = SimpleNamespace(front=SimpleNamespace(encode=encode, pool=None))
    add_sglang_routes(app, SimpleNamespace(ready_runtime=lambda: rt), timeout=5, pusher=_StalledPusher())
    return app


def _post(app, path: str, content: bytes) -> httpx.Response:
    import asyncio

    async def go():
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://encoder") as c:
            return await c.post(path, content=content, headers={"content-type": "application/json"})
    return asyncio.run(go())


_PART = {"req_id": "r_local_part_0", "modality": "IMAGE", "mm_items": ["data:image/png;base64,AAAA"],
         "num_parts": 1, "part_idx": 0, "prefill_host": "127.0.0.1", "embedding_port": 5}


def test_a_push_the_prefill_never_takes_is_a_504_not_a_500():
    from types import SimpleNamespace

    from epd_encoder.errors import UnsupportedMedia
    from epd_encoder.types import ItemOutput

    out = ItemOutput(torch.zeros(4, 8))
    encoded = SimpleNamespace(result=SimpleNamespace(items=[SimpleNamespace(output=out)], release=lambda: None),
                              prepared=[SimpleNamespace(grid_thw=(1, 4, 4), meta=None)])

    async def ok(body):
        return encoded

    r = _post(_protocol_app(ok), "/encode", json.dumps(_PART).encode())
    assert r.status_code == 504, r.text

    async def bad(body):  # the error part stalls too: the client still hears the encode's own error
        raise UnsupportedMedia("not an image")

    r = _post(_protocol_app(bad), "/encode", json.dumps(_PART).encode())
    assert r.status_code == 415, r.text


@pytest.mark.parametrize("path", ["/scheduler_receive_url", "/encode"])
@pytest.mark.parametrize("content", [b"{not json", b"[" * 100_000], ids=["malformed", "too-deep"])
def test_a_body_that_does_not_parse_is_a_422(path, content):
    async def never(body):
        raise AssertionError("nothing to encode")

    r = _post(_protocol_app(never), path, content)
    assert r.status_code == 422, r.text


def test_an_unsupported_item_option_is_named_and_the_supported_ones_are_not():
    from epd_encoder.errors import SchemaError
    from epd_encoder.integrations.sglang_encoder import encode_body

    item = {"url": "data:image/png;base64,AAAA", "content_hash": "h", "detail": "auto", "max_pixels": 1}
    with pytest.raises(SchemaError) as e:
        encode_body({**_PART, "mm_items": [item]})
    assert "['max_pixels']" in e.value.message


@pytest.mark.parametrize("path,tail", [
    ("/encode", b',"prefill_host":"10.0.0.9"}'),
    ("/scheduler_receive_url", b',"receive_url":"tcp://10.0.0.9:7"}'),
])
def test_a_key_named_twice_is_a_422_and_nothing_is_encoded(path, tail):
    # As on /v1/encode (api/parse.py): last-wins would push to another host than a gateway reading the first saw.
    async def never(body):
        raise AssertionError("nothing to encode")

    first = dict(_PART, receive_count=1, receive_url="tcp://127.0.0.1:7")
    r = _post(_protocol_app(never), path, json.dumps(first).encode()[:-1] + tail)
    assert r.status_code == 422 and "duplicate key" in r.json()["error"]["message"], r.text
