# SPDX-License-Identifier: Apache-2.0
"""delivery.mode = "ec_store": the server writes each item where vLLM's ECExampleConnector reads
it, answers only then, and answers like pull without urls; a server without a store says 422."""

from __future__ import annotations

import base64
from dataclasses import replace

import httpx
import pytest
import torch
from safetensors.torch import load_file

from epd_encoder.config.ec_store import ECStoreConfig
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, png, serve_config
from tests.transfer.ec.test_mooncake_store import mooncake_master  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def store_server(tiny_qwen3_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ec_store")
    s = Server(replace(serve_config(tiny_qwen3_dir), ec_store=ECStoreConfig(ec_store_path=str(root)))).start()
    yield s, root
    s.stop()


def _body(mode: str) -> dict:
    return {"items": [{"type": "image", "image": base64.b64encode(png(i, (56, 84))).decode()} for i in range(2)],
            "delivery": {"mode": mode}}


def test_items_land_in_the_example_connector_layout_with_deepstack(store_server):
    server, root = store_server
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/encode", json=_body("ec_store"))
        assert r.status_code == 200, r.text
        _, inline = unpack_inline(c.post("/v1/encode", json=_body("inline")).content)
        assert "ec_store" in c.get("/info").json()["features"]["delivery_modes"]
    items = r.json()["items"]
    assert [i["key"] for i in items] == [m.key for m, _ in inline]
    assert all("url" not in i for i in items)
    for meta, out in inline:
        assert meta.num_deepstack > 0  # Qwen3-VL: the file holds [rows, hidden * (1 + deepstack)]
        rows = load_file(root / meta.key / "encoder_cache.safetensors")["ec_cache"]
        assert torch.equal(rows, torch.cat([out.embedding, *out.deepstack], -1))


def test_a_server_without_a_store_refuses_the_mode(server):
    r = httpx.post(f"{server.url}/v1/encode", json=_body("ec_store"), timeout=60)
    assert r.status_code == 422
    assert "--ec-store-path" in r.json()["error"]["message"]
    assert "ec_store" not in httpx.get(f"{server.url}/info").json()["features"]["delivery_modes"]


def test_mooncake_store_holds_vllms_objects_after_the_answer(tiny_dir, mooncake_master):  # noqa: F811
    from epd_encoder.transfer.ec.mooncake_store import MooncakeEmbeddingStore, embedding_key, encode_object

    master, metadata = mooncake_master
    cfg = ECStoreConfig(ec_store_mooncake=master, ec_store_namespace="ns", ec_store_metadata_server=metadata,
                        ec_store_dtype="bfloat16")
    server = Server(replace(serve_config(tiny_dir), ec_store=cfg)).start()
    # The objects live in the segment the server mounted: read them while it runs.
    reader = MooncakeEmbeddingStore.connect(master, "ns", metadata_server=metadata, segment_bytes=16 << 20,
                                            buffer_bytes=16 << 20)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            items = c.post("/v1/encode", json=_body("ec_store")).json()["items"]
            _, inline = unpack_inline(c.post("/v1/encode", json=_body("inline")).content)
        for item, (meta, out) in zip(items, inline):
            got = bytes(reader.client.get(embedding_key("ns", item["key"])))
            assert got == encode_object(out.embedding.to(torch.bfloat16))
    finally:
        reader.close()
        server.stop()
