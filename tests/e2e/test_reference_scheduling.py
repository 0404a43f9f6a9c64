# SPDX-License-Identifier: Apache-2.0
"""A ``--scheduling reference`` server (the comparison baseline) serves the same
embeddings and coalesces nothing (docs/scheduler.md, "Reference scheduling")."""

from __future__ import annotations

import threading
from dataclasses import replace

import httpx
import pytest
import torch

from epd_encoder.cli import build_parser
from epd_encoder.config import CacheConfig, ServeConfig
from epd_encoder.flags import resolve
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, body, delta, flat_png, png, scrape, wait_for


@pytest.fixture(scope="module")
def reference(tiny_dir):
    # From the command line, as an operator would start it; one item per forward, and
    # LRU so that nothing first-seen is refused a cache slot.
    ns = build_parser().parse_args(["serve", "--model", str(tiny_dir), "--model-id", "tiny-test",
                                    "--scheduling", "reference", "--max-batch-items", "1"])
    config, _ = resolve(ServeConfig, ns, environ={})
    assert config.engine.scheduler.scheduling == "reference"
    config = replace(config, engine=replace(config.engine, cache=CacheConfig(admission="lru")))
    s = Server(config).start()
    yield s
    s.stop()


def encode(c: httpx.Client, *images: bytes) -> list:
    r = c.post("/v1/encode", json=body(*images))
    assert r.status_code == 200, r.text
    return unpack_inline(r.content)[1]


def test_embeddings_equal_the_default_servers(reference, server):
    images = [png(11), png(12, size=(64, 200))]
    with httpx.Client(base_url=reference.url, timeout=60) as ref, \
            httpx.Client(base_url=server.url, timeout=60) as ours:
        for image in images:
            # One item per request on each server: a batch of one both ways, the same computation.
            (m_ref, o_ref), = encode(ref, image)
            (m_ours, o_ours), = encode(ours, image)
            assert (m_ref.key, m_ref.num_tokens, tuple(m_ref.grid_thw)) == \
                   (m_ours.key, m_ours.num_tokens, tuple(m_ours.grid_thw))
            assert torch.equal(o_ref.embedding, o_ours.embedding)


def test_concurrent_duplicates_are_encoded_again_not_coalesced(reference):
    x, y = flat_png(101), flat_png(102)
    out: dict[str, list] = {}

    def post(name, *images):
        with httpx.Client(base_url=reference.url, timeout=60) as cl:
            out[name] = encode(cl, *images)

    with httpx.Client(base_url=reference.url, timeout=60) as c:
        before = scrape(c)
        with reference.held_forward() as in_forward:
            a = threading.Thread(target=post, args=("a", x, y))
            a.start()
            assert in_forward.wait(30)  # x in the tower (one item per forward), y queued
            b = threading.Thread(target=post, args=("b", y))
            b.start()  # y is queued for a: a coalescing server would attach b to it
            assert wait_for(lambda: reference.runtime.engine.active_requests == 2)
        a.join(60)
        b.join(60)
        assert [m.cache for m, _ in out["a"]] == ["miss", "miss"]
        assert [m.cache for m, _ in out["b"]] == ["miss"]
        assert torch.equal(out["a"][1][1].embedding, out["b"][0][1].embedding)
        assert wait_for(lambda: reference.runtime.engine.active_requests == 0)
        assert delta(c, before, "epd_coalesced_total") == 0
        assert delta(c, before, "epd_items_total", cache="miss") == 3
        assert delta(c, before, "epd_batch_items_count") == 3  # y went through the tower twice
        (m, _), = encode(c, y)
        assert m.cache == "hit"  # no coalescing, but the cache still serves
