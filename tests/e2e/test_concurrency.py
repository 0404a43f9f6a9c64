# SPDX-License-Identifier: Apache-2.0
"""Concurrent and failing requests against a real server: pins, admission, coalescing."""

from __future__ import annotations

import io
import threading
from dataclasses import replace

import httpx
import pytest
from PIL import Image

from epd_encoder.config import CacheConfig, EngineConfig
from epd_encoder.engine.cost import item_cost
from epd_encoder.preprocess.registry import load_preprocessor
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, b64, body, serve_config, wait_for

SIDE = 448  # the tiny model's max pixels: 256 tokens, 48 KiB of float32 output per image


def flat_png(seed: int) -> bytes:
    """A distinct (by colour), cheap-to-encode image of SIDE x SIDE pixels."""
    buf = io.BytesIO()
    Image.new("RGB", (SIDE, SIDE), (seed % 251, seed // 251 % 251, 7)).save(buf, "PNG")
    return buf.getvalue()


def image_cost(tiny_dir) -> int:
    grid, _ = load_preprocessor(tiny_dir).predict(SIDE, SIDE)
    return item_cost(grid)


@pytest.fixture(scope="module")
def small(tiny_dir):
    """A 1 MiB LRU cache (about 20 images) and a pending bound of 1.5 images."""
    engine = replace(EngineConfig(), cache=CacheConfig(cache_mb=1, admission="lru"),
                     max_pending_cost=image_cost(tiny_dir) * 3 // 2)
    s = Server(serve_config(tiny_dir, engine=engine)).start()
    yield s
    s.stop()


@pytest.fixture
def c(small):
    with httpx.Client(base_url=small.url, timeout=30) as cl:
        yield cl


def states(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [meta.cache for meta, _ in unpack_inline(r.content)[1]]


def quiet(server) -> None:
    """No request is outstanding (its ledger entry goes just after its answer)."""
    assert wait_for(lambda: server.runtime.engine.active_requests == 0)


def test_a_failed_sibling_does_not_keep_a_hit_pinned(small, c):
    hot = flat_png(1)
    assert states(c.post("/v1/encode", json=body(hot))) == ["miss"]
    bad = {"type": "image", "image": "!!!!"}
    for _ in range(5):
        r = c.post("/v1/encode", json={"items": [bad, {"type": "image", "image": b64(hot)}]})
        assert r.status_code == 400, r.text
    # Fresh traffic well over the cache's capacity pushes the hot image out of the LRU.
    for start in range(100, 140, 4):
        quiet(small)  # each request is over the pending bound: it needs an empty queue
        assert states(c.post("/v1/encode", json=body(*map(flat_png, range(start, start + 4))))) == ["miss"] * 4
    assert states(c.post("/v1/encode", json=body(hot))) == ["miss"]
    assert wait_for(lambda: small.runtime.cache.stats.pinned == 0)


def test_concurrent_duplicates_are_admitted_at_the_cost_of_one(small, c):
    quiet(small)
    image, codes, results = flat_png(2), [], []

    def post():
        r = c.post("/v1/encode", json=body(image))
        codes.append(r.status_code)
        results.append(r)

    with small.paused_engine():
        threads = [threading.Thread(target=post) for _ in range(8)]
        for t in threads:
            t.start()
        # Every request is either accepted (waiting on the paused engine) or answered.
        assert wait_for(lambda: small.runtime.engine.active_requests + len(codes) == 8)
    for t in threads:
        t.join(30)
    assert codes == [200] * 8
    assert sorted(s for r in results for s in states(r)) == ["coalesced"] * 7 + ["miss"]


def test_duplicates_are_admitted_while_the_queue_is_at_its_bound(tiny_dir):
    """Pending work at exactly the bound: new images get 429 before decoding,
    duplicates of the queued one are still admitted and coalesce."""
    engine = replace(EngineConfig(), max_pending_cost=image_cost(tiny_dir))
    server = Server(serve_config(tiny_dir, engine=engine)).start()
    image, codes = flat_png(3), []

    def post(data):
        with httpx.Client(base_url=server.url, timeout=30) as cl:
            r = cl.post("/v1/encode", json=body(data))
        codes.append(r.status_code)
        return r

    try:
        with server.paused_engine():
            first = threading.Thread(target=post, args=(image,))
            first.start()
            assert wait_for(lambda: server.runtime.engine.outstanding_cost == image_cost(tiny_dir))
            assert post(flat_png(4)).status_code == 429  # new work over the bound
            dups = [threading.Thread(target=post, args=(image,)) for _ in range(4)]
            for t in dups:
                t.start()
            assert wait_for(lambda: server.runtime.engine.active_requests == 5)
        for t in (first, *dups):
            t.join(30)
        assert sorted(codes) == [200] * 5 + [429]
    finally:
        server.stop()
