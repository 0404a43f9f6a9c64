# SPDX-License-Identifier: Apache-2.0
"""The shared tier (L3) end to end: real servers against a real ``mooncake_master`` on loopback."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import pytest
import torch

from epd_encoder.cache.shared_format import meta_key, value_key
from epd_encoder.config import ModelConfig
from epd_encoder.config.shared_cache import SharedCacheConfig
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, body, metric, png, scrape, serve_config, wait_for
from tests.mooncake_master import Master, free_port, master_process  # noqa: F401  (fixture)

NS = "test-ns"


def _config(model_dir, master: Master, *, batch_invariant=False, **shared):
    opts = dict(shared_cache=f"mooncake://{master.address}", shared_cache_namespace=NS, shared_cache_segment_mb=64,
                shared_cache_buffer_mb=32, shared_cache_lease_s=1.0, shared_cache_breaker_cooldown=60.0)
    cfg = serve_config(model_dir, shared=SharedCacheConfig(**{**opts, **shared}))
    return replace(cfg, model=replace(cfg.model, batch_invariant=batch_invariant))


def _encode(server: Server, *images: bytes) -> list:
    r = httpx.post(f"{server.url}/v1/encode", json=body(*images), timeout=60)
    assert r.status_code == 200, r.text
    return unpack_inline(r.content)[1]


def _connected(server: Server) -> bool:
    with httpx.Client(base_url=server.url) as c:
        return metric(c, "epd_shared_cache_breaker_info", state="down") == 0


def _writes(server: Server) -> float:
    with httpx.Client(base_url=server.url) as c:
        return metric(c, "epd_shared_cache_writes_total")


@pytest.fixture
def pair(tiny_qwen3_dir, master_process):  # noqa: F811
    a = Server(_config(tiny_qwen3_dir, master_process)).start()
    b = Server(_config(tiny_qwen3_dir, master_process)).start()
    assert wait_for(lambda: _connected(a) and _connected(b), 60)
    yield a, b, master_process
    a.stop()
    b.stop()


def _same(x, y) -> bool:
    return torch.equal(x.embedding, y.embedding) and all(
        torch.equal(p, q) for p, q in zip(x.deepstack or (), y.deepstack or (), strict=True))


def test_an_encode_on_one_server_is_a_shared_hit_on_the_other(pair):
    a, b, _ = pair
    image = png(1)
    [(meta_a, out_a)] = _encode(a, image)
    assert meta_a.cache == "miss" and meta_a.tier is None
    assert wait_for(lambda: _writes(a) == 1)
    with httpx.Client(base_url=b.url) as c:
        work = lambda: [metric(c, f"epd_{m}_seconds_count") for m in ("preprocess", "forward")]  # noqa: E731
        before = work()
        [(meta_b, out_b)] = _encode(b, image)
        assert work() == before  # no decode, no preprocessing, no forward on B
    assert (meta_b.cache, meta_b.tier) == ("hit", "shared")
    assert meta_b.num_deepstack == meta_a.num_deepstack > 0 and meta_b.grid_thw == meta_a.grid_thw
    assert _same(out_a, out_b)
    [(again, _)] = _encode(b, image)  # promoted to B's L1
    assert (again.cache, again.tier) == ("hit", "device")
    with httpx.Client(base_url=b.url) as c:
        assert metric(c, "epd_cache_hits_total", tier="shared") == 1
        assert metric(c, "epd_shared_cache_bytes_total", direction="read") > 0
        assert metric(c, "epd_shared_cache_breaker_info", state="closed") == 1


def test_a_corrupt_value_is_a_counted_miss_then_removed(pair):
    a, b, master = pair
    from mooncake.store import MooncakeDistributedStore

    image = png(2)
    [(meta_a, out_a)] = _encode(a, image)
    assert wait_for(lambda: _writes(a) == 1)
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    try:
        vkey = value_key(NS, meta_a.key)
        good = bytes(raw.get(vkey))
        assert raw.remove(vkey, True) == 0  # forced: the test's own read holds a lease
        bad = bytearray(good)
        bad[-1] ^= 0xFF  # one flipped bit of the last row: only the checksum can tell
        assert raw.put(vkey, bytes(bad)) == 0
        [(meta_b, out_b)] = _encode(b, image)
        assert meta_b.cache == "miss"  # encoded afresh, never served from the corrupt entry
        assert _same(out_a, out_b)
        with httpx.Client(base_url=b.url) as c:
            assert metric(c, "epd_shared_cache_corrupt_total") == 1
            assert metric(c, "epd_cache_misses_total", tier="shared") == 1
            # Removed once the read's lease (1 s on this master) has ended.
            assert wait_for(lambda: metric(c, "epd_shared_cache_removals_total") == 1, 30)
        assert raw.is_exist(vkey) == 0 and raw.is_exist(meta_key(NS, meta_a.key)) == 0
    finally:
        raw.close()


def test_requests_still_succeed_as_misses_after_the_master_dies(pair):
    a, b, master = pair
    _encode(a, png(3))
    assert wait_for(lambda: _writes(a) == 1)
    master.kill()
    for seed in range(10, 18):  # fresh images: each looks L3 up and then writes to it
        t0 = time.monotonic()
        [(meta, _)] = _encode(b, png(seed))
        assert meta.cache == "miss"
        assert time.monotonic() - t0 < 30  # bounded by the deadlines, never hanging
    [(meta, _)] = _encode(b, png(3))  # A's entry is gone with the master: a miss, not an error
    assert meta.cache == "miss"
    with httpx.Client(base_url=b.url) as c:
        assert wait_for(lambda: metric(c, "epd_shared_cache_breaker_info", state="open") == 1, 30)
        errors = sum(v for (name, _), v in scrape(c).items() if name == "epd_shared_cache_errors_total")
        assert errors >= 5


def test_a_shared_hit_equals_a_fresh_encode_bitwise_under_batch_invariance(tiny_qwen3_dir, master_process):  # noqa: F811
    writer = Server(_config(tiny_qwen3_dir, master_process, batch_invariant=True)).start()
    reader = Server(_config(tiny_qwen3_dir, master_process, batch_invariant=True)).start()
    fresh = Server(replace(serve_config(tiny_qwen3_dir), model=ModelConfig(
        model=str(tiny_qwen3_dir), model_id="tiny-test", batch_invariant=True))).start()
    try:
        assert wait_for(lambda: _connected(writer) and _connected(reader), 60)
        target = png(4, size=(64, 96))
        _encode(writer, png(5, size=(160, 128)), target, png(6))  # encoded inside a batch of three
        assert wait_for(lambda: _writes(writer) == 3)
        [(hit_meta, hit)] = _encode(reader, target)
        [(fresh_meta, alone)] = _encode(fresh, target)  # encoded alone, on a server without L3
        assert (hit_meta.cache, hit_meta.tier, fresh_meta.cache) == ("hit", "shared", "miss")
        assert hit_meta.key == fresh_meta.key
        assert _same(hit, alone)
    finally:
        for s in (writer, reader, fresh):
            s.stop()


def test_a_server_whose_master_is_down_serves_misses_and_connects_once_it_is_up(tiny_dir, tmp_path):
    pytest.importorskip("mooncake.store")
    port = free_port()
    down = type("Down", (), {"address": f"127.0.0.1:{port}"})()
    server = Server(_config(tiny_dir, down, shared_cache_breaker_cooldown=0.2)).start()
    master = None
    try:
        # Mooncake's setup holds the GIL for ~90 s against a dead master: a client set up
        # regardless would freeze this whole process, HTTP included, past these timeouts.
        with httpx.Client(base_url=server.url, timeout=10) as c:
            for seed in range(3):
                assert c.get("/health").status_code == 200
                [(meta, _)] = _encode(server, png(seed))
                assert meta.cache == "miss"
            assert metric(c, "epd_shared_cache_breaker_info", state="down") == 1
            assert metric(c, "epd_shared_cache_errors_total", op="get", reason="down") == 3
        master = Master(tmp_path / "master.log", port=port)
        assert wait_for(lambda: _connected(server), 60)
        _encode(server, png(7))
        assert wait_for(lambda: _writes(server) == 1)
    finally:
        server.stop()
        if master is not None:
            master.stop()


def test_push_writes_its_encodes_and_answers_shared_hits_with_their_tier(pair):
    from epd_encoder.receiver import EmbeddingReceiver

    a, b, _ = pair
    image = png(8)
    with EmbeddingReceiver(backend="tcp", pool_bytes=8 << 20) as rx:
        r = httpx.post(f"{a.url}/v1/encode", json=body(image, delivery=rx.delivery("room-a")), timeout=30)
        assert r.status_code == 202 and r.json()["items"][0]["cache"] == "pending"
        [pushed_a] = rx.wait("room-a", timeout=30)
        assert wait_for(lambda: _writes(a) == 1)  # written from the push path too
        r = httpx.post(f"{b.url}/v1/encode", json=body(image, delivery=rx.delivery("room-b")), timeout=30)
        assert r.status_code == 202
        info = r.json()["items"][0]
        assert (info["cache"], info["tier"]) == ("hit", "shared")
        [pushed_b] = rx.wait("room-b", timeout=30)
    assert torch.equal(pushed_a.embedding, pushed_b.embedding)
    assert all(torch.equal(x, y) for x, y in zip(pushed_a.deepstack, pushed_b.deepstack, strict=True))
