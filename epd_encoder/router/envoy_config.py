# SPDX-License-Identifier: Apache-2.0
"""The Envoy bootstrap the router runs: one listener, one cluster of encode servers.

Everything that balances is Envoy's (docs/router.md): consistent hashing on the routing-key
headers with a load bound, active health checks, outlier ejection, retries to another host
within a budget, membership by DNS or from a watched EDS file, and a header-based stateful
session that sends a pull fetch back to the server that holds the item.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epd_encoder.config.router import RouterConfig
from epd_encoder.router.membership import Backend

CLUSTER = "encoders"
ROUTING_HEADERS = ("x-epd-routing-key", "x-smg-routing-key")
# Envoy sets it on each answer (base64 of the server's address); a request carrying it goes
# to that server if it is still a healthy member (strict: else 503, never another server).
SESSION_HEADER = "x-epd-upstream"
# The splitter marks push sub-requests: their retries exclude resets (docs/router.md, "Push").
PUSH_HEADER = "x-epd-delivery"

_T = "type.googleapis.com/envoy."


def _seconds(s: float) -> str:
    return f"{s:.3f}s"


def _retry_policy(config: RouterConfig, on: str) -> dict[str, Any]:
    return {
        "retry_on": on,
        "retriable_status_codes": [429, 503],
        "num_retries": config.retries,
        "per_try_timeout": _seconds(config.try_timeout),
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": _T + "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
        }],
        # A re-selection walks on from the key's place on the ring, where one server's entries often
        # run in a row: at 5, a retry now and then landed on the refusing server again.
        "host_selection_retry_max_attempts": 32,
        "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
    }


def _route(config: RouterConfig, match: dict[str, Any], retry_on: str) -> dict[str, Any]:
    return {
        "match": match,
        "route": {
            "cluster": CLUSTER,
            "timeout": _seconds(config.request_timeout),
            # The first header present decides; both absent: any healthy server.
            "hash_policy": [{"header": {"header_name": h}, "terminal": True} for h in ROUTING_HEADERS],
            "retry_policy": _retry_policy(config, retry_on),
        },
    }


def _listener(config: RouterConfig, port: int) -> dict[str, Any]:
    push = {"prefix": "/", "headers": [{"name": PUSH_HEADER, "string_match": {"exact": "push"}}]}
    manager = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "router",
        "codec_type": "AUTO",
        "stream_idle_timeout": _seconds(config.request_timeout + 5),
        "route_config": {"virtual_hosts": [{
            "name": CLUSTER,
            "domains": ["*"],
            "request_body_buffer_limit": config.max_body_mb << 20,
            "routes": [
                # A reset after a push was accepted may be mid-delivery: no retry on reset.
                _route(config, push, "connect-failure,refused-stream,retriable-status-codes"),
                _route(config, {"prefix": "/"}, "connect-failure,refused-stream,reset,retriable-status-codes"),
            ],
        }]},
        "http_filters": [
            {"name": "envoy.filters.http.stateful_session", "typed_config": {
                "@type": _T + "extensions.filters.http.stateful_session.v3.StatefulSession",
                "strict": True,
                "session_state": {
                    "name": "envoy.http.stateful_session.header",
                    "typed_config": {
                        "@type": _T + "extensions.http.stateful_session.header.v3.HeaderBasedSessionState",
                        "name": SESSION_HEADER,
                    },
                },
            }},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": _T + "extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "name": "encode",
        # On --host only when asked for (--envoy-port): else the splitter's, on loopback.
        "address": {"socket_address": {"address": config.host if config.envoy_port else "127.0.0.1",
                                       "port_value": port}},
        "per_connection_buffer_limit_bytes": 1 << 20,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": manager}]}],
    }


def _cluster(config: RouterConfig, backends: list[Backend], eds_file: Path | None) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": CLUSTER,
        "connect_timeout": "1s",
        "lb_policy": config.lb_policy.upper(),
        # A server taken out of the membership gets no new work at once, healthy or not.
        "ignore_health_on_host_removal": True,
        "common_lb_config": {
            "consistent_hashing_lb_config": {"hash_balance_factor": config.hash_balance_factor},
            # Never send to unhealthy servers, even when most are (Envoy's panic mode would).
            "healthy_panic_threshold": {"value": 0.0},
        },
        "health_checks": [{
            "timeout": _seconds(config.health_timeout),
            "interval": _seconds(config.health_interval),
            "no_traffic_interval": _seconds(config.health_interval),
            "unhealthy_threshold": config.unhealthy_threshold,
            "healthy_threshold": 1,
            "http_health_check": {"path": "/health"},
        }],
        "outlier_detection": {
            "consecutive_5xx": config.consecutive_failures + 2,
            "consecutive_gateway_failure": config.consecutive_failures,
            "enforcing_consecutive_gateway_failure": 100,
            "interval": "1s",
            "base_ejection_time": _seconds(config.ejection_seconds),
            "max_ejection_percent": config.max_ejection_percent,
        },
        "circuit_breakers": {"thresholds": [{
            "max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000,
            "retry_budget": {"budget_percent": {"value": config.retry_budget_percent},
                             "min_retry_concurrency": config.retry_budget_min},
        }]},
        # Per-server requests, errors and health in /stats/prometheus.
        "track_cluster_stats": {"per_endpoint_stats": True},
        "per_connection_buffer_limit_bytes": 1 << 20,
    }
    if config.lb_policy == "ring_hash":
        cluster["ring_hash_lb_config"] = {"minimum_ring_size": 1024}
    if eds_file is not None:
        cluster["type"] = "EDS"
        cluster["eds_cluster_config"] = {"eds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": str(eds_file),
                                   "watched_directory": {"path": str(eds_file.parent)}},
        }}
    else:
        # Envoy's strict-DNS cluster: one endpoint per address a name resolves to (a headless
        # Service's pods), re-resolved every 5 s or at the record's TTL.
        cluster["cluster_type"] = {"name": "envoy.clusters.dns", "typed_config": {
            "@type": _T + "extensions.clusters.dns.v3.DnsCluster",
            "respect_dns_ttl": True, "dns_refresh_rate": "5s"}}
        cluster["load_assignment"] = {"cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": b.host, "port_value": b.port}}}}
            for b in backends]}]}
    return cluster


def bootstrap(config: RouterConfig, backends: list[Backend], *, eds_file: Path | None,
              admin_port: int, listener_port: int) -> dict[str, Any]:
    """The whole bootstrap, as the JSON Envoy reads with ``-c``; ``eds_file`` (absolute) or
    ``backends`` names the membership."""
    return {
        "node": {"id": "epd-router", "cluster": "epd-router"},
        # Bounds the router's open client connections (Envoy warns when none is set).
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": _T + "extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": 50000,
            },
        }]},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [_listener(config, listener_port)],
            "clusters": [_cluster(config, backends, eds_file)],
        },
    }
