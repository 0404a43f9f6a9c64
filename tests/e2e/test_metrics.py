# SPDX-License-Identifier: Apache-2.0
"""Every /metrics series, read after real traffic that moves it (docs/operations.md)."""

from __future__ import annotations

import threading
from dataclasses import replace

import httpx
import pytest

from epd_encoder.config import CacheConfig, EngineConfig, SchedulerConfig
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, body, delta, flat_png, metric, scrape, serve_config, wait_for

MiB = 1 << 20
BUDGET = SchedulerConfig().max_batch_cost
PATCHES = 32 * 32  # a 448x448 image at patch 14: the cost of one flat_png item


def start(tiny_dir, *, l2_mb: int = 0, batch_items: int = 64) -> Server:
    # 1 MiB tiers hold about 21 full-size tiny items; LRU keeps the counts predictable.
    engine = replace(EngineConfig(), scheduler=replace(SchedulerConfig(), max_batch_items=batch_items),
                     cache=CacheConfig(cache_mb=1, host_cache_mb=l2_mb, admission="lru"))
    return Server(serve_config(tiny_dir, engine=engine)).start()


@pytest.fixture
def tiered(tiny_dir):
    s = start(tiny_dir, l2_mb=1, batch_items=2)
    yield s
    s.stop()


@pytest.fixture
def single(tiny_dir):
    s = start(tiny_dir)
    yield s
    s.stop()


def encode(c: httpx.Client, *images: bytes) -> httpx.Response:
    r = c.post("/v1/encode", json=body(*images))
    assert r.status_code == 200, r.text
    return r


def states(r: httpx.Response) -> list[str]:
    return [meta.cache for meta, _ in unpack_inline(r.content)[1]]


def item_bytes(r: httpx.Response) -> int:
    (_, out), = unpack_inline(r.content)[1]
    assert out.deepstack is None  # the tiny qwen2.5 model has none: the embedding is the cache entry
    return out.embedding.nbytes


def idle(c: httpx.Client, s: Server) -> None:
    """Nothing queued, nothing owed, nothing pinned: what every test must return to."""
    assert wait_for(lambda: s.runtime.engine.active_requests == 0)
    now = scrape(c)
    assert metric(now, "epd_queued_items") == 0 and metric(now, "epd_pending_cost_patches") == 0
    assert metric(now, "epd_cache_pinned_entries") == 0 and metric(now, "epd_cache_pinned_bytes") == 0


def test_queue_batches_latencies_coalescing_and_bytes_out(tiered):
    x, y, z = flat_png(1), flat_png(2), flat_png(3)
    out: dict[str, httpx.Response] = {}

    def post(name, *images):
        with httpx.Client(base_url=tiered.url, timeout=60) as cl:
            out[name] = cl.post("/v1/encode", json=body(*images))

    with httpx.Client(base_url=tiered.url, timeout=60) as c:
        before = scrape(c)
        with tiered.held_forward() as in_forward:
            a = threading.Thread(target=post, args=("a", x, y, z))
            a.start()
            assert in_forward.wait(30)  # [x, y] in the tower (two items per batch), z queued
            assert metric(c, "epd_queued_items") == 1
            assert metric(c, "epd_pending_cost_patches") == 3 * PATCHES
            b = threading.Thread(target=post, args=("b", z))
            b.start()  # z is already in flight: b will wait on it, not encode it again
            assert wait_for(lambda: tiered.runtime.engine.active_requests == 2)
            assert metric(c, "epd_pending_cost_patches") == 3 * PATCHES  # z is charged once (to a)
        a.join(60)
        b.join(60)
        assert states(out["a"]) == ["miss"] * 3 and states(out["b"]) == ["coalesced"]
        idle(c, tiered)
        moved = lambda name, **labels: delta(c, before, name, **labels)  # noqa: E731
        assert moved("epd_coalesced_total") == 1
        assert moved("epd_items_total", cache="miss") == 3 and moved("epd_items_total", cache="coalesced") == 1
        assert moved("epd_requests_total", route="/v1/encode", status="200") == 2
        assert moved("epd_bytes_out_total") == len(out["a"].content) + len(out["b"].content)
        # Two forwards: [x, y] then [z].
        assert moved("epd_batch_items_count") == 2 and moved("epd_batch_items_sum") == 3
        assert moved("epd_batch_items_bucket", le="1.0") == 1 and moved("epd_batch_items_bucket", le="2.0") == 2
        assert moved("epd_batch_fill_ratio_count") == 2
        assert moved("epd_batch_fill_ratio_sum") == pytest.approx(3 * PATCHES / BUDGET)
        assert moved("epd_forward_seconds_count") == 2 and moved("epd_forward_seconds_sum") > 0
        assert moved("epd_queue_seconds_count") == 3 and moved("epd_queue_seconds_sum") > 0
        assert moved("epd_preprocess_seconds_count") >= 3 and moved("epd_preprocess_seconds_sum") > 0
        assert moved("epd_delivery_seconds_count") == 2 and moved("epd_delivery_seconds_sum") > 0
        encoded = dict(route="/v1/encode", method="POST", status_class="2xx")
        assert moved("epd_request_duration_seconds_count", **encoded) == 2
        assert moved("epd_request_duration_seconds_sum", **encoded) > 0
        # Pull bytes count too: the GET body is what leaves the server.
        before = scrape(c)
        info = c.post("/v1/encode", json=body(x, delivery={"mode": "pull"})).json()["items"][0]
        got = c.get(info["url"])
        assert got.status_code == 200 and moved("epd_bytes_out_total") == len(got.content)
        # The route template, not the key in the path: one series for every pull.
        assert moved("epd_request_duration_seconds_count", route="/v1/embeddings/{key}", method="GET",
                     status_class="2xx") == 1
        assert not any(n.startswith("epd_request") and info["key"] in dict(lb).get("route", "")
                       for n, lb in scrape(c))


def test_cache_tiers_count_misses_hits_demotions_and_evictions(tiered):
    with httpx.Client(base_url=tiered.url, timeout=120) as c:
        nbytes = item_bytes(encode(c, flat_png(100)))
        fit = MiB // nbytes  # entries per 1 MiB tier
        before = scrape(c)
        images = [flat_png(200 + i) for i in range(2 * fit + 3)]  # both tiers full, 3 over
        for image in images:  # one per request: a request pins its own items until it ends
            assert states(encode(c, image)) == ["miss"]
        moved = lambda name, **labels: delta(c, before, name, **labels)  # noqa: E731
        # Each miss is looked up in both tiers; L1 keeps the newest, its victims go down,
        # and L2, full as well, drops the oldest of what it was given.
        assert moved("epd_cache_misses_total", tier="l1") == len(images)
        assert moved("epd_cache_misses_total", tier="l2") == len(images)
        assert moved("epd_cache_demotions_total", tier="l1") == len(images) + 1 - fit
        assert moved("epd_cache_evictions_total", tier="l2") == len(images) + 1 - 2 * fit
        assert moved("epd_cache_evictions_total", tier="l1") == 0  # L2 took every L1 victim
        assert metric(c, "epd_cache_bytes", tier="l1") == fit * nbytes
        assert metric(c, "epd_cache_bytes", tier="l2") == fit * nbytes
        assert metric(c, "epd_cache_demotions_total", tier="l2") == 0  # L2 is the bottom tier

        before = scrape(c)
        assert states(encode(c, images[-1])) == ["hit"]  # still in L1
        assert moved("epd_cache_hits_total", tier="l1") == 1
        assert states(encode(c, images[3])) == ["hit"]  # the oldest L2 still holds: promoted
        assert moved("epd_cache_hits_total", tier="l2") == 1
        assert moved("epd_cache_misses_total", tier="l1") == 1
        assert moved("epd_cache_misses_total", tier="l2") == 0
        assert moved("epd_items_total", cache="hit") == 2
        idle(c, tiered)


def test_single_tier_evictions_pins_and_refused_puts(single):
    with httpx.Client(base_url=single.url, timeout=120) as c:
        nbytes = item_bytes(encode(c, flat_png(300)))
        fit = MiB // nbytes
        before = scrape(c)
        images = [flat_png(301 + i) for i in range(fit)]  # with flat_png(300): one over
        for image in images:
            encode(c, image)
        assert delta(c, before, "epd_cache_evictions_total", tier="l1") == 1
        assert metric(c, "epd_cache_bytes", tier="l1") == fit * nbytes

        # A request's cache hits stay pinned until it ends: here, until its miss is encoded.
        # With every entry pinned, that miss cannot be stored.
        newcomer = flat_png(999)
        before = scrape(c)
        done: list[httpx.Response] = []
        def send():
            with httpx.Client(base_url=single.url, timeout=120) as cl:
                done.append(encode(cl, *images, newcomer))

        with single.paused_engine():
            t = threading.Thread(target=send)
            t.start()
            assert wait_for(lambda: single.runtime.engine.active_requests == 1)
            assert metric(c, "epd_cache_pinned_entries") == fit
            assert metric(c, "epd_cache_pinned_bytes") == fit * nbytes
        t.join(60)
        assert states(done[0]) == ["hit"] * fit + ["miss"]
        assert delta(c, before, "epd_cache_rejected_total", tier="l1") == 1
        assert delta(c, before, "epd_cache_evictions_total", tier="l1") == 0
        idle(c, single)
        assert states(encode(c, newcomer)) == ["miss"]  # it was never stored


def test_push_rooms_bytes_and_transfer_time(tiny_dir):
    from epd_encoder.config import PushConfig
    from epd_encoder.receiver import EmbeddingReceiver
    from tests.e2e.harness import png, serve_config

    s = Server(serve_config(tiny_dir, push=replace(PushConfig(), bootstrap_timeout=0.5))).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            before = scrape(c)
            moved = lambda name, **labels: delta(c, before, name, **labels)  # noqa: E731
            with EmbeddingReceiver(backend="tcp", pool_bytes=8 << 20) as rx:
                r = c.post("/v1/encode", json=body(png(1), png(2, (56, 200)), delivery=rx.delivery("ok")))
                assert r.status_code == 202, r.text
                items = rx.wait("ok", timeout=20)
            sent = sum(item.embedding.nbytes for item in items)
            assert wait_for(lambda: scrape(c).get(("epd_push_rooms_total", frozenset({("outcome", "done")}))))
            assert moved("epd_push_rooms_total", outcome="done") == 1
            assert moved("epd_push_bytes_total") == sent
            assert moved("epd_push_transfer_seconds_count") == 1 and moved("epd_push_transfer_seconds_sum") > 0
            # A receiver that is gone: the room times out waiting for its Accept; no bytes go out.
            gone = EmbeddingReceiver(backend="tcp")
            delivery = gone.delivery("gone")
            gone.close()
            assert c.post("/v1/encode", json=body(png(3), delivery=delivery)).status_code == 202
            assert wait_for(lambda: scrape(c).get(("epd_push_rooms_total", frozenset({("outcome", "timeout")}))),
                            timeout=15)
            assert moved("epd_push_rooms_total", outcome="timeout") == 1
            assert moved("epd_push_bytes_total") == sent and moved("epd_push_transfer_seconds_count") == 1
    finally:
        s.stop()
