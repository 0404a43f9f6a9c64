# SPDX-License-Identifier: Apache-2.0
"""Membership from an EDS file that Envoy watches: a change applies live, without a restart."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from epd_encoder.router.membership import Backend, eds_document, write_eds_file
from tests.e2e.harness import body, png, wait_for
from tests.router.route_harness import Router, envoy_or_skip, served, servers, tiny_dir  # noqa: F401


def test_backend_urls_become_host_and_port():
    assert Backend.from_url("http://10.0.0.7:8000") == Backend("10.0.0.7", 8000)
    assert Backend.from_url("http://encoders.default.svc") == Backend("encoders.default.svc", 80)
    for bad in ("https://a:1", "http://a:1/v1", "a:1"):
        with pytest.raises(ValueError):
            Backend.from_url(bad)


def test_the_eds_file_is_what_envoy_reads(tmp_path):
    write_eds_file(tmp_path / "eds.json", [Backend("127.0.0.1", 1), Backend("127.0.0.2", 2)])
    doc = json.loads((tmp_path / "eds.json").read_text())
    assert doc == eds_document([Backend("127.0.0.1", 1), Backend("127.0.0.2", 2)])
    assert [p.name for p in tmp_path.iterdir()] == ["eds.json"]  # the temporary file was renamed


def test_a_changed_backends_file_takes_effect_without_a_restart(servers, tmp_path):
    a, b = servers[0], servers[1]
    eds = tmp_path / "members" / "eds.json"
    eds.parent.mkdir()
    write_eds_file(eds, [Backend.from_url(a.url)])
    router = Router("--backends-file", str(eds), log=tmp_path / "route.log")
    try:
        router.wait_healthy(1)
        pid = router.proc.pid
        with httpx.Client(base_url=router.url, timeout=60) as c:
            before = served(a), served(b)
            assert c.post("/v1/encode", json=body(png(8000), png(8001))).status_code == 200
            assert (served(a) - before[0], served(b) - before[1]) == (2, 0)
            pulled = c.post("/v1/encode", json=body(png(8003), delivery={"mode": "pull"})).json()
            assert c.get(pulled["items"][0]["url"]).status_code == 200

            write_eds_file(eds, [Backend.from_url(b.url)])
            address = b.url.removeprefix("http://")
            # Envoy lists the new member at once; it takes work after its first health check.
            assert wait_for(lambda: router.hosts() == {address: "healthy"} and router.answers(), 30), router.hosts()
            before = served(a), served(b)
            r = c.post("/v1/encode", json=body(png(8000), png(8002)))
            assert r.status_code == 200, r.text
            assert (served(a) - before[0], served(b) - before[1]) == (0, 2)

            # A pull id held by a server that left the fleet: 503, never another server's 404.
            gone = pulled["items"][0]["url"]
            fetched = c.get(gone)
            assert fetched.status_code == 503 and fetched.json()["error"]["code"] == "not_ready"

            write_eds_file(eds, [Backend.from_url(a.url), Backend.from_url(b.url)])
            assert wait_for(lambda: router.healthy_servers() == 2, 30), router.hosts()
        assert router.proc.poll() is None and router.proc.pid == pid
    finally:
        router.stop()


def test_a_backends_file_envoy_cannot_read_stops_the_start(tmp_path):
    envoy_or_skip()
    eds = tmp_path / "eds.json"
    eds.write_text("resources: [ {")
    r = subprocess.run([sys.executable, "-m", "epd_encoder.cli", "route", "--backends-file", str(eds),
                        "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "ERROR epd_encoder.router.app: envoy could not read --backends-file" in r.stderr


def test_a_yaml_backends_file_as_the_docs_show_it(servers, tmp_path):
    port = int(servers[2].url.rpartition(":")[2])
    eds = tmp_path / "encoders.yaml"
    eds.write_text(f"""resources:
- "@type": type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment
  cluster_name: encoders
  endpoints:
  - lb_endpoints:
    - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}
""")
    router = Router("--backends-file", str(eds), log=tmp_path / "route.log")
    try:
        router.wait_healthy(1)
        assert router.hosts() == {f"127.0.0.1:{port}": "healthy"}
    finally:
        router.stop()
