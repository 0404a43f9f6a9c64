# SPDX-License-Identifier: Apache-2.0
"""Auth is decided on the headers, before a byte of the body is read."""

from __future__ import annotations

import threading

import httpx

from epd_encoder.config import AuthConfig
from tests.e2e.harness import Server, body, png, serve_config
from tests.e2e.hostile import AUTH, KEY, HealthProbe, connect, read_until_closed, status_of, trickle

BIG = 100 << 20


def test_unauthenticated_invalid_json_gets_401_not_422(locked):
    r = httpx.post(f"{locked.url}/v1/encode", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "unauthorized"


def test_a_big_unauthenticated_body_is_refused_before_it_is_read(locked):
    """100 MB declared, a few bytes sent: the 401 comes at once and the connection closes,
    so the server neither buffers nor waits for the rest."""
    with HealthProbe(locked.url, AUTH) as probe:
        socks = [connect(locked.url) for _ in range(6)]
        try:
            for s in socks:
                s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n{\"items\": [" % BIG)
            for s in socks:
                data, closed_after = read_until_closed(s, timeout=5)
                assert status_of(data) == 401, data[:200]
                assert closed_after is not None, "the connection stayed open for the rest of the body"
        finally:
            for s in socks:
                s.close()
    probe.check(name="big unauthenticated bodies")


def test_a_trickled_unauthenticated_body_is_refused_at_once(locked):
    s = connect(locked.url)
    stop = threading.Event()
    try:
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        feeder = threading.Thread(target=trickle, args=(s, b"x" * 1000, 0.05, stop), daemon=True)
        feeder.start()
        data, closed_after = read_until_closed(s, timeout=5)
        assert status_of(data) == 401 and closed_after is not None and closed_after < 5
    finally:
        stop.set()
        s.close()


def test_wrong_key_is_401_and_the_right_key_encodes(locked):
    with httpx.Client(base_url=locked.url, timeout=30) as c:
        assert c.post("/v1/encode", json=body(png(7)),
                      headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/health").status_code == 401
        assert c.get("/metrics").status_code == 401
        assert c.get("/v1/unknown").status_code == 401  # the route table is not shown to strangers
        r = c.post("/v1/encode", json=body(png(7)), headers=AUTH)
        assert r.status_code == 200, r.text
        assert c.get("/health", headers=AUTH).status_code == 200
        assert c.get("/metrics", headers=AUTH).status_code == 200


def test_health_and_metrics_stay_open_without_the_protect_flags(tiny_dir):
    s = Server(serve_config(tiny_dir, auth=AuthConfig(api_key=KEY))).start()
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/metrics").status_code == 200
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers=AUTH).status_code == 200
    finally:
        s.stop()
