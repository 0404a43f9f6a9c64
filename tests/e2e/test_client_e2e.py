# SPDX-License-Identifier: Apache-2.0
"""EncodeClient and AsyncEncodeClient against a real server."""

from __future__ import annotations

import asyncio

import pytest
import torch

from epd_encoder.client import AsyncEncodeClient, EncodeClient
from epd_encoder.errors import TooManyItems, UndecodableImage
from tests.e2e.harness import png


def test_sync_client_inline_pull_and_errors(server):
    images = [png(300), png(301, (56, 200))]
    with EncodeClient(server.url) as client:
        assert client.health()
        assert client.models()[0]["id"] == "tiny-test"
        inline = client.encode(images, request_id="client-1")
        assert inline.request_id == "client-1" and len(inline.items) == 2
        pulled = client.encode(images, delivery="pull", fetch=True)
        assert [i.cache for i in pulled.items] == ["hit", "hit"]
        for a, b in zip(inline.items, pulled.items):
            assert a.key == b.key and a.grid_thw == b.grid_thw
            torch.testing.assert_close(a.embedding, b.embedding, atol=0, rtol=0)
        with pytest.raises(UndecodableImage):
            client.encode([png(1)[:100]])
        with pytest.raises(TooManyItems):
            client.encode([png(2, (28, 28))] * 65)


def test_async_client_concurrent_requests(server):
    async def main():
        async with AsyncEncodeClient(server.url) as client:
            results = await asyncio.gather(*(client.encode([png(400 + i % 3)]) for i in range(9)))
            return results

    results = asyncio.run(main())
    states = sorted(r.items[0].cache for r in results)
    assert states.count("miss") == 3 and len(states) == 9
    by_key = {}
    for r in results:
        by_key.setdefault(r.items[0].key, []).append(r.items[0].embedding)
    assert len(by_key) == 3
    for embs in by_key.values():
        for e in embs[1:]:
            assert torch.equal(e, embs[0])


def test_sync_client_push_delivery(server):
    from epd_encoder.receiver import EmbeddingReceiver

    with EmbeddingReceiver(backend="tcp") as rx, EncodeClient(server.url) as client:
        meta = client.encode([png(500), png(501, (56, 84))], delivery=rx.delivery("client-push"))
        assert [m.cache for m in meta.items] == ["pending", "pending"]
        assert all(m.embedding is None for m in meta.items)
        items = rx.wait("client-push", timeout=20)
        again = client.encode([png(500)])  # now cached
        assert again.items[0].cache == "hit"
        torch.testing.assert_close(items[0].embedding, again.items[0].embedding, atol=0, rtol=0)
        assert [i.num_tokens for i in items] == [m.num_tokens for m in meta.items]
        with pytest.raises(ValueError):
            client.encode([png(1)], delivery={"mode": "inline"})
