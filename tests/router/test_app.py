# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder route`` end to end: a real Envoy under the real command, real encode servers
on loopback. Which server served an item is read from each server's own ``epd_items_total``."""

from __future__ import annotations

import httpx
import pytest
import torch

from epd_encoder.router.split import routing_key
from epd_encoder.wire import unpack_inline, unpack_item
from tests.e2e.harness import b64, body, flat_png, png, scrape, wait_for
from tests.router.route_harness import Router, Stub, envoy_or_skip, served, servers, tiny_dir  # noqa: F401


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory):
    r = Router(*(a for s in servers for a in ("--backend", s.url)),
               log=tmp_path_factory.mktemp("route") / "route.log")
    yield r.wait_healthy(len(servers)).settle(len(servers))
    r.stop()


@pytest.fixture
def client(router):
    with httpx.Client(base_url=router.url, timeout=60) as c:
        yield c


def test_the_same_item_goes_to_the_same_server_every_time(servers, router, client):
    for seed in range(6):
        first = client.post("/v1/encode", json=body(png(1000 + seed)))
        assert first.status_code == 200, first.text
        before = [served(s) for s in servers]
        for _ in range(3):
            again = client.post("/v1/encode", json=body(png(1000 + seed)))
            _, [(meta, _)] = unpack_inline(again.content)
            assert meta.cache == "hit", router.hosts()  # a server that never saw the image would miss
        moved = [served(s) - b for s, b in zip(servers, before)]
        assert sorted(moved) == [0, 0, 3], moved


def test_items_of_one_request_spread_over_servers_and_come_back_in_order(servers, client):
    images = [png(2000 + i) for i in range(6)]
    before = [served(s) for s in servers]
    r = client.post("/v1/encode", json=body(*images, request_id="multi-1"))
    assert r.status_code == 200, r.text
    info, items = unpack_inline(r.content)
    assert info["request_id"] == "multi-1" and len(items) == 6
    assert sum(served(s) - b for s, b in zip(servers, before)) == 6
    assert sum(served(s) > b for s, b in zip(servers, before)) >= 2  # split, not sent whole
    with httpx.Client(base_url=servers[0].url, timeout=60) as direct:
        for image, (meta, output) in zip(images, items):
            _, [(want_meta, want)] = unpack_inline(direct.post("/v1/encode", json=body(image)).content)
            assert meta.key == want_meta.key and meta.grid_thw == want_meta.grid_thw
            assert torch.equal(output.embedding, want.embedding)


def test_answers_over_64_kib_are_reassembled_off_the_loop_alike(servers, client):
    images = [flat_png(2200 + i) for i in range(4)]  # 256 tokens each: 48 KiB of fp32 per item
    r = client.post("/v1/encode", json=body(*images))
    assert r.status_code == 200, r.text
    assert len(r.content) > 64 << 10
    _, items = unpack_inline(r.content)
    with httpx.Client(base_url=servers[0].url, timeout=60) as direct:
        _, want = unpack_inline(direct.post("/v1/encode", json=body(*images)).content)
    for (meta, output), (want_meta, want_output) in zip(items, want):
        assert meta.key == want_meta.key  # one batch there, four here: equal within fp32 noise
        torch.testing.assert_close(output.embedding, want_output.embedding, atol=1e-5, rtol=0)


def test_a_chat_body_is_split_like_items(client):
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(png(2100 + i))}}
             for i in range(3)]
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}
    r = client.post("/v1/encode", json=chat)
    assert r.status_code == 200, r.text
    _, items = unpack_inline(r.content)
    inline = unpack_inline(client.post("/v1/encode", json=body(*(png(2100 + i) for i in range(3)))).content)[1]
    assert [m.key for m, _ in items] == [m.key for m, _ in inline]
    assert all(m.cache == "hit" for m, _ in inline)  # same keys, same servers


def test_pull_ids_are_fetched_through_the_router_from_the_server_that_holds_them(client):
    images = [png(3000 + i) for i in range(4)]
    r = client.post("/v1/encode", json=body(*images, delivery={"mode": "pull"}))
    assert r.status_code == 200, r.text
    answer = r.json()
    inline = unpack_inline(client.post("/v1/encode", json=body(*images)).content)[1]
    for item, (meta, output) in zip(answer["items"], inline):
        got = client.get(item["url"])
        assert got.status_code == 200, got.text
        _, got_meta, got_output = unpack_item(got.content)
        assert got_meta.key == meta.key == item["key"]
        assert torch.equal(got_output.embedding, output.embedding)


def test_a_bad_item_fails_the_request_with_the_servers_own_error(client):
    r = client.post("/v1/encode", json=body(png(4000), b"not an image", png(4001)))
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media"
    r = client.post("/v1/encode", content=b'{"items": [')
    assert r.status_code == 422 and r.json()["error"]["code"] == "schema_error"
    r = client.post("/v1/encode", json={"items": [{"type": "image", "image": b64(png(1))}] * 65})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_items"


def test_smg_routing_key_reaches_the_same_server_as_the_router(servers, router, client):
    image = png(5000)
    assert client.post("/v1/encode", json=body(image)).status_code == 200
    r = httpx.post(router.envoy + "/v1/encode", json=body(image), timeout=60,
                   headers={"x-smg-routing-key": routing_key(b64(image))})
    assert r.status_code == 200, r.text
    assert unpack_inline(r.content)[1][0][0].cache == "hit"


def test_other_routes_answer_like_a_server(servers, client):
    assert client.get("/health").json() == {"status": "ok", "healthy_servers": 3}
    assert client.get("/info").json()["model"] == "tiny-test"
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-test"


def test_metrics_expose_the_routers_and_envoys_per_server_stats(servers, client):
    assert client.post("/v1/encode", json=body(png(6000), png(6001))).status_code == 200
    samples = scrape(client)
    names = {name for name, _ in samples}
    assert samples[("epd_router_requests_total", frozenset({("status", "200")}))] >= 1
    for s in servers:
        address = s.url.removeprefix("http://")
        labels = {("envoy_cluster_name", "encoders"), ("envoy_endpoint_address", address),
                  ("envoy_endpoint_hostname", "127.0.0.1")}
        assert ("envoy_cluster_endpoint_rq_total", frozenset(labels)) in samples
    # prometheus_client's parser names a counter's sample with _total (Envoy's text has none).
    for name in ("envoy_cluster_upstream_rq_retry_total", "envoy_cluster_outlier_detection_ejections_enforced_total",
                 "envoy_cluster_upstream_rq_time_bucket", "envoy_cluster_membership_healthy"):
        assert name in names, name


@pytest.mark.parametrize("status", [429, 503])
def test_a_refusing_server_spills_its_items_to_another(servers, status, tmp_path):
    stub = Stub(status)
    flags = [a for s in servers[:2] for a in ("--backend", s.url)]
    router = Router("--backend", stub.url, *flags, log=tmp_path / "route.log")
    try:
        router.wait_healthy(3).settle(3)
        with httpx.Client(base_url=router.url, timeout=60) as c:
            # Concurrent misses: the servers hold requests outstanding while the stub holds
            # none, so the load bound steers keys to it (docs/router.md, "the load bound").
            # Rounds until the stub has refused some (12 keys can all miss it).
            for round in range(10):
                images = [png(7000 + 100 * status + 12 * round + i) for i in range(12)]
                r = c.post("/v1/encode", json=body(*images))
                assert r.status_code == 200, r.text
                assert len(unpack_inline(r.content)[1]) == 12
                if stub.posts() > 0:
                    break
            assert stub.posts() > 0  # some keys went to the stub; each was retried elsewhere
            retries = scrape(c)[("envoy_cluster_upstream_rq_retry_total", frozenset({("envoy_cluster_name", "encoders")}))]
            assert retries >= 1
    finally:
        router.stop()
        stub.stop()


def test_requests_fail_fast_when_no_server_is_healthy(tmp_path):
    envoy_or_skip()
    stub = Stub(429)
    router = Router("--backend", stub.url, log=tmp_path / "route.log")
    try:
        router.wait_healthy(1)
        stub.stop()
        assert wait_for(lambda: router.healthy_servers() == 0, 30)
        r = httpx.post(router.url + "/v1/encode", json=body(png(1)), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    finally:
        router.stop()


def test_push_goes_whole_to_the_first_items_server_and_its_room_is_queried_there(servers, client):
    from epd_encoder.receiver import EmbeddingReceiver

    images = [png(9000 + i) for i in range(3)]
    before = [served(s) for s in servers]
    with EmbeddingReceiver(backend="tcp") as rx:
        r = client.post("/v1/encode", json=body(*images, delivery=rx.delivery("fleet-room")))
        assert r.status_code == 202, r.text
        items = rx.wait("fleet-room", timeout=30)
        assert [i.key for i in items] == [i["key"] for i in r.json()["items"]]
        upstream = r.headers["x-epd-upstream"]  # the server that delivers into the room
        status = client.get("/v1/rooms/fleet-room", params={"receiver": rx.endpoint, "upstream": upstream})
        assert status.status_code == 200 and status.json()["state"] == "done", status.text
    moved = [served(s) - b for s, b in zip(servers, before)]
    assert sorted(moved) == [0, 0, 3], moved  # one server delivered all three
    first = client.post("/v1/encode", json=body(images[0]))
    assert unpack_inline(first.content)[1][0][0].cache == "hit"  # ... the first item's server


def test_two_routers_send_a_key_to_the_same_server(servers, router, client, tmp_path):
    other = Router(*(a for s in servers for a in ("--backend", s.url)), log=tmp_path / "route2.log")
    try:
        other.wait_healthy(len(servers)).settle(len(servers))
        assert other.routes() == router.routes()
        with httpx.Client(base_url=other.url, timeout=60) as c2:
            for seed in range(4):
                image = png(9500 + seed)
                assert client.post("/v1/encode", json=body(image)).status_code == 200
                r = c2.post("/v1/encode", json=body(image))
                assert unpack_inline(r.content)[1][0][0].cache == "hit"
    finally:
        other.stop()


def test_a_pull_fetch_never_reaches_an_address_outside_the_fleet(client):
    import base64

    stub = Stub(429)  # answers 200 to any GET: reaching it would show
    try:
        r = client.post("/v1/encode", json=body(png(9700), delivery={"mode": "pull"}))
        key = r.json()["items"][0]["key"]
        outside = base64.b64encode(stub.url.removeprefix("http://").encode()).decode()
        got = client.get(f"/v1/embeddings/{key}", params={"upstream": outside})
        assert got.status_code == 503 and got.json()["error"]["code"] == "not_ready", got.text
    finally:
        stub.stop()


# -- the splitter's answers against a fake Envoy (no processes) ------------------------------


class _FakeEnvoy:
    listener_url, admin_url = "http://envoy", "http://envoy-admin"

    def alive(self) -> bool:
        return True


def _front(answer, **config):
    """The router's app over ``answer(request)`` as Envoy's listener (its admin: no stats)."""
    from fastapi.testclient import TestClient

    from epd_encoder.config.router import RouterConfig
    from epd_encoder.router.app import create_router_app

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "envoy-admin":
            return httpx.Response(200, text="")
        return answer(request)

    upstream = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return TestClient(create_router_app(RouterConfig(**config), _FakeEnvoy(), upstream))


@pytest.mark.parametrize("images", [1, 3])
def test_a_servers_401_keeps_its_www_authenticate_header(images):
    def answer(request):
        return httpx.Response(401, json={"error": {"code": "unauthorized", "message": "bad key"}},
                              headers={"WWW-Authenticate": "Bearer"})

    with _front(answer) as c:
        r = c.post("/v1/encode", json=body(*(png(2300 + i) for i in range(images))))
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert r.headers.get("www-authenticate") == "Bearer"  # what a server's 401 carries (api/errors.py)


def test_requests_the_router_answers_with_an_error_are_counted_by_status():
    def unreachable(request):
        raise httpx.ConnectError("refused", request=request)

    with _front(unreachable, max_body_mb=1) as c:
        assert c.post("/v1/encode", json=body(png(2310), png(2311))).status_code == 503
        assert c.post("/v1/encode", content=b"x" * (2 << 20),
                      headers={"content-type": "application/json"}).status_code == 413
        text = c.get("/metrics").text
    assert 'epd_router_requests_total{status="503"} 1.0' in text, text
    assert 'epd_router_requests_total{status="413"} 1.0' in text, text
    assert "epd_router_request_seconds_count 2.0" in text, text


def test_a_client_gone_mid_body_is_a_499_not_a_500():
    import asyncio

    with _front(lambda request: httpx.Response(200)) as c:  # the test client only builds the app
        app = c.app
        messages = [{"type": "http.request", "body": b'{"items": [', "more_body": True}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/encode", "raw_path": b"/v1/encode", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
                 "server": ("router", 80), "client": ("client", 1)}
        asyncio.run(app(scope, receive, send))  # raised ClientDisconnect: a 500 and a logged traceback
        text = c.get("/metrics").text
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    assert 'epd_router_requests_total{status="499"} 1.0' in text, text


def test_an_unknown_path_or_method_gets_a_servers_error_body():
    with _front(lambda request: httpx.Response(200)) as c:
        missing, wrong = c.get("/v1/nothing"), c.get("/v1/encode")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", missing.text
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed", wrong.text
