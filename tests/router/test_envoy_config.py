# SPDX-License-Identifier: Apache-2.0
"""The bootstrap: what the flags put in it, and Envoy's own validation of it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from epd_encoder.config.router import RouterConfig
from epd_encoder.router.envoy_config import ROUTING_HEADERS, SESSION_HEADER, bootstrap
from epd_encoder.router.membership import Backend, write_eds_file
from tests.router.route_harness import envoy_or_skip


def _cluster(b: dict) -> dict:
    return b["static_resources"]["clusters"][0]


def _routes(b: dict) -> list[dict]:
    manager = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return manager["route_config"]["virtual_hosts"][0]["routes"]


def test_flags_reach_the_balancer_health_checks_and_retries():
    config = RouterConfig(backend=("http://a:1",), lb_policy="maglev", hash_balance_factor=150, retries=3,
                          health_interval=2.0, consecutive_failures=4, retry_budget_percent=40.0,
                          retry_budget_min=7)
    b = bootstrap(config, [Backend("a", 1)], eds_file=None, admin_port=0, listener_port=0)
    cluster = _cluster(b)
    assert cluster["lb_policy"] == "MAGLEV" and cluster["cluster_type"]["name"] == "envoy.clusters.dns"
    assert cluster["common_lb_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] == 150
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/health"
    assert cluster["health_checks"][0]["interval"] == "2.000s"
    assert cluster["outlier_detection"]["consecutive_gateway_failure"] == 4
    budget = cluster["circuit_breakers"]["thresholds"][0]["retry_budget"]
    assert budget == {"budget_percent": {"value": 40.0}, "min_retry_concurrency": 7}
    push, default = _routes(b)
    assert [h["header"]["header_name"] for h in default["route"]["hash_policy"]] == list(ROUTING_HEADERS)
    assert default["route"]["retry_policy"]["num_retries"] == 3
    assert default["route"]["retry_policy"]["retriable_status_codes"] == [429, 503]
    assert "reset" in default["route"]["retry_policy"]["retry_on"].split(",")
    # A push accepted and then reset may be mid-delivery: never retried on reset.
    assert "reset" not in push["route"]["retry_policy"]["retry_on"].split(",")
    assert push["match"]["headers"][0]["name"] == "x-epd-delivery"


def test_a_backends_file_is_watched_by_its_directory(tmp_path):
    eds = tmp_path / "eds.json"
    b = bootstrap(RouterConfig(backends_file=str(eds)), [], eds_file=eds, admin_port=0, listener_port=0)
    source = _cluster(b)["eds_cluster_config"]["eds_config"]["path_config_source"]
    assert source == {"path": str(eds), "watched_directory": {"path": str(tmp_path)}}


@pytest.mark.parametrize("policy", ["ring_hash", "maglev"])
@pytest.mark.parametrize("membership", ["dns", "file"])
def test_envoy_accepts_the_bootstrap(policy, membership, tmp_path):
    envoy = envoy_or_skip()
    eds = tmp_path / "eds.json" if membership == "file" else None
    if eds is not None:
        write_eds_file(eds, [Backend("127.0.0.1", 9)])
    config = RouterConfig(backend=() if eds else ("http://127.0.0.1:9",),
                          backends_file=str(eds) if eds else None, lb_policy=policy)
    path = Path(tmp_path / "envoy.json")
    path.write_text(json.dumps(bootstrap(config, [Backend("127.0.0.1", 9)], eds_file=eds,
                                         admin_port=0, listener_port=0)))
    r = subprocess.run([envoy, "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "deprecated" not in (r.stdout + r.stderr).lower()
    assert SESSION_HEADER in path.read_text()


def test_envoys_listener_is_on_host_only_when_its_port_is_asked_for():
    def address(config: RouterConfig) -> str:
        b = bootstrap(config, [], eds_file=None, admin_port=0, listener_port=config.envoy_port)
        return b["static_resources"]["listeners"][0]["address"]["socket_address"]["address"]

    assert address(RouterConfig(backend=("http://a:1",), host="0.0.0.0")) == "127.0.0.1"
    assert address(RouterConfig(backend=("http://a:1",), host="0.0.0.0", envoy_port=8091)) == "0.0.0.0"
    assert bootstrap(RouterConfig(backend=("http://a:1",)), [], eds_file=None, admin_port=0,
                     listener_port=0)["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
