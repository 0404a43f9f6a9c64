# SPDX-License-Identifier: Apache-2.0
"""Inline and pull round trips against a real server, equal to the direct executor."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest
import torch
from safetensors.torch import load as st_load

from epd_encoder.preprocess.decode import decode_image
from epd_encoder.wire import unpack_inline, unpack_item
from tests.e2e.harness import Server, b64, body, delta, flat_png, png, scrape, serve_config, wait_for


def direct(server, data: bytes):
    rt = server.runtime
    item = rt.preprocessor.preprocess(decode_image(data, rt.front.decode_limits))
    return rt.executor.encode([item])[0]


def test_inline_round_trip_equals_the_direct_executor(server, client):
    images = [png(1, (64, 64)), png(2, (120, 200)), png(3, (300, 90))]
    r = client.post("/v1/encode", json=body(*images, request_id="rt-inline"))
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    head, items = unpack_inline(r.content)
    assert head["request_id"] == "rt-inline" and head["model"] == "tiny-test"
    assert [m.cache for m, _ in items] == ["miss"] * 3
    for data, (meta, out) in zip(images, items):
        ref = direct(server, data)
        assert meta.num_tokens == ref.embedding.shape[0]
        torch.testing.assert_close(out.embedding, ref.embedding, atol=1e-5, rtol=0)
    # The raw body is a plain safetensors file any reader understands.
    assert set(st_load(r.content)) == {f"item.{i}.embedding" for i in range(3)}


def test_pull_round_trip(server, client):
    data = png(10)
    r = client.post("/v1/encode", json=body(data, delivery={"mode": "pull"}))
    assert r.status_code == 200
    info = r.json()["items"][0]
    assert info["url"] == f"/v1/embeddings/{info['key']}" and info["grid_thw"][0] == 1
    got = client.get(info["url"])
    assert got.status_code == 200
    model, meta, out = unpack_item(got.content)
    assert model == "tiny-test" and meta.key == info["key"] and meta.num_tokens == info["num_tokens"]
    torch.testing.assert_close(out.embedding, direct(server, data).embedding, atol=1e-5, rtol=0)
    missing = client.get("/v1/embeddings/" + "0" * 64)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


PULL = {"mode": "pull"}


def test_pull_entries_expire_after_the_ttl(tiny_dir):
    ttl = 2.0
    s = Server(serve_config(tiny_dir, pull_ttl=ttl)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            # The entry is stored after t0, so a GET answered before t0 + ttl must find it.
            # A machine too loaded to answer within the TTL retries rather than guesses.
            for attempt in range(5):
                t0 = time.monotonic()
                r = c.post("/v1/encode", json=body(flat_png(500 + attempt), delivery=PULL))
                assert r.status_code == 200, r.text
                url = r.json()["items"][0]["url"]
                got = c.get(url)
                if time.monotonic() - t0 < ttl:
                    assert got.status_code == 200
                    break
            else:
                pytest.fail(f"no pull GET was answered within the {ttl} s TTL in 5 tries")
            assert wait_for(lambda: c.get(url).status_code == 404, timeout=ttl + 30)
            assert time.monotonic() - t0 >= ttl  # not dropped before its TTL
            assert c.get(url).json()["error"]["code"] == "not_found"
            assert len(s.runtime.pull_store) == 0 and s.runtime.pull_store.current_bytes == 0
    finally:
        s.stop()


def test_pull_store_drops_the_oldest_entries_past_its_byte_bound(tiny_dir):
    s = Server(serve_config(tiny_dir, pull_store_mb=1)).start()  # the 300 s TTL never fires here
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.post("/v1/encode", json=body(flat_png(600), delivery=PULL))
            assert r.status_code == 200, r.text
            oldest = r.json()["items"][0]["url"]
            got = c.get(oldest)
            assert got.status_code == 200
            nbytes = unpack_item(got.content)[2].embedding.nbytes
            fit = (1 << 20) // nbytes  # as many more as the bound holds: one too many in all
            assert 1 < fit <= 64
            r = c.post("/v1/encode", json=body(*[flat_png(601 + i) for i in range(fit)], delivery=PULL))
            assert r.status_code == 200, r.text
            assert c.get(oldest).status_code == 404  # oldest out first
            assert all(c.get(it["url"]).status_code == 200 for it in r.json()["items"])
            assert s.runtime.pull_store.current_bytes == fit * nbytes <= 1 << 20
    finally:
        s.stop()


def test_openai_chat_body_images_in_order(server, client):
    a, b = png(20), png(21)
    chat = {"model": "whatever", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(a)}"}},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(b)}"}}]}]}
    r = client.post("/v1/encode", json=chat)
    assert r.status_code == 200
    _, items = unpack_inline(r.content)
    for data, (_, out) in zip((a, b), items):
        torch.testing.assert_close(out.embedding, direct(server, data).embedding, atol=1e-5, rtol=0)


def test_many_concurrent_clients_with_duplicates(server, client):
    pool = [png(100 + i, (64 + 8 * i, 96)) for i in range(5)]
    before = scrape(client)
    states, errors = Counter(), []

    def worker(c):
        with httpx.Client(base_url=server.url, timeout=60) as cl:
            for j in range(4):
                imgs = [pool[(c + j) % 5], pool[(c * 3 + j) % 5]]
                r = cl.post("/v1/encode", json=body(*imgs))
                if r.status_code != 200:
                    errors.append(r.text)
                    continue
                for meta, _ in unpack_inline(r.content)[1]:
                    states[meta.cache] += 1

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert states["miss"] == 5  # each distinct image encoded once
    assert sum(states.values()) == 12 * 4 * 2
    assert delta(client, before, "epd_items_total", cache="miss") == 5
    assert delta(client, before, "epd_items_total", cache="hit") == states["hit"]
    assert delta(client, before, "epd_items_total", cache="coalesced") == states["coalesced"] > 0
    assert delta(client, before, "epd_cache_hits_total", tier="l1") >= states["hit"]


def test_deepstack_model_ships_every_tensor(tiny_qwen3_dir):
    s = Server(serve_config(tiny_qwen3_dir)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            r = c.post("/v1/encode", json=body(png(5), png(6, (64, 200))))
            assert r.status_code == 200
            _, items = unpack_inline(r.content)
            ref = direct(s, png(5))
            meta, out = items[0]
            assert meta.num_deepstack == len(ref.deepstack) > 0
            for got, want in zip(out.deepstack, ref.deepstack):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        s.stop()


def test_per_request_pixel_overrides_change_grid_and_key(server, client):
    data = png(77, (448, 448))
    base = unpack_inline(client.post("/v1/encode", json=body(data)).content)[1][0][0]
    small = client.post("/v1/encode", json=body(data, max_pixels=112 * 112))
    assert small.status_code == 200
    meta = unpack_inline(small.content)[1][0][0]
    assert meta.key != base.key and meta.cache == "miss"
    assert meta.grid_thw[1] * meta.grid_thw[2] < base.grid_thw[1] * base.grid_thw[2]
    too_big = client.post("/v1/encode", json=body(data, max_pixels=10**9))
    assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "invalid_input"
