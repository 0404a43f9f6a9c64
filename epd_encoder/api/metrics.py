# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics, on a registry per server (no global state).

Names follow Prometheus conventions: counters end in ``_total``, every other
name ends in its unit (``_seconds``, ``_bytes``, ``_ratio``, ``_patches``,
``_items``, ``_entries``). Labels are bounded: ``route`` is the matched route
template (never the raw path), ``method`` one of the HTTP methods, ``outcome``
one of the error codes. docs/operations.md lists every series.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


class _CacheCollector:
    """Reads the cache's own counters at scrape time, per tier, and its pins."""

    def __init__(self, cache: Any, shared: Callable[[], Any]) -> None:
        self._cache, self._shared = cache, shared

    def collect(self):
        stats = self._cache.stats
        tiers = {"l1": stats.l1, "l2": stats.l2} if getattr(stats, "l1", None) else {"l1": stats}
        fams = {
            "hits": CounterMetricFamily("epd_cache_hits", "Cache hits per tier", labels=["tier"]),
            "misses": CounterMetricFamily("epd_cache_misses", "Cache misses per tier", labels=["tier"]),
            "evictions": CounterMetricFamily("epd_cache_evictions", "Entries evicted per tier", labels=["tier"]),
            "demotions": CounterMetricFamily("epd_cache_demotions", "Entries demoted per tier", labels=["tier"]),
            "rejected": CounterMetricFamily("epd_cache_rejected", "Puts refused per tier", labels=["tier"]),
        }
        used = GaugeMetricFamily("epd_cache_bytes", "Bytes held per tier", labels=["tier"])
        for name, s in tiers.items():
            for attr, fam in fams.items():
                fam.add_metric([name], getattr(s, attr))
            used.add_metric([name], s.current_bytes)
        shared = self._shared()
        if shared is not None:  # L3 (cache/shared.py): its other series are epd_shared_cache_*
            s3 = shared.stats
            fams["hits"].add_metric(["shared"], s3.hits)
            fams["misses"].add_metric(["shared"], s3.misses)
        yield from fams.values()
        yield used
        # Pins span tiers; after traffic both fall back to 0, else a delivery leaked a pin.
        pins = self._cache.pinned_stats()
        yield GaugeMetricFamily("epd_cache_pinned_entries", "Cache keys held by in-flight deliveries",
                                value=pins.entries)
        yield GaugeMetricFamily("epd_cache_pinned_bytes", "Stored bytes of the pinned cache keys",
                                value=pins.bytes)


class _SharedCacheCollector:
    """The shared tier's own series, read at scrape time (hits and misses are epd_cache_*)."""

    def __init__(self, tier: Any) -> None:
        self._tier = tier

    def collect(self):
        from epd_encoder.cache.shared_breaker import STATES

        t = self._tier
        s = t.stats
        errors = CounterMetricFamily("epd_shared_cache_errors", "Shared-tier operations that failed, "
                                     "by op (get, put, remove) and reason (down, open, busy, timeout, error)",
                                     labels=["op", "reason"])
        for (op, reason), n in sorted(s.errors.items()):
            errors.add_metric([op, reason], n)
        yield errors
        yield CounterMetricFamily("epd_shared_cache_corrupt", "Shared-tier entries that failed validation "
                                  "(served as misses, then removed)", value=s.corrupt)
        moved = CounterMetricFamily("epd_shared_cache_bytes", "Shared-tier object bytes read (hits) and written",
                                    labels=["direction"])
        moved.add_metric(["read"], s.bytes_read)
        moved.add_metric(["written"], s.bytes_written)
        yield moved
        yield CounterMetricFamily("epd_shared_cache_writes", "Entries written to the shared tier", value=s.writes)
        dropped = CounterMetricFamily("epd_shared_cache_writes_dropped", "Writes not attempted, by reason "
                                      "(queue_full, too_large)", labels=["reason"])
        for reason, n in sorted(s.dropped.items()):
            dropped.add_metric([reason], n)
        yield dropped
        yield CounterMetricFamily("epd_shared_cache_removals", "Entries removed: corrupt, or left without "
                                  "their sidecar by a failed or late write", value=s.removals)
        # A state set (1 on the current state): "down" until the client is set up, then the breaker's.
        now = t.store.breaker.state if t.store.connected else "down"
        state = GaugeMetricFamily("epd_shared_cache_breaker_info", "Shared store: down (not connected yet), "
                                  "closed, open (operations skipped) or half_open (one probing)", labels=["state"])
        for name in ("down", *STATES):
            state.add_metric([name], int(name == now))
        yield state
        yield GaugeMetricFamily("epd_shared_cache_write_queue_items", "Encoded items waiting to be written",
                                value=t.queued_writes)


class _CumulativeCounter:
    """A counter whose cumulative value lives elsewhere (the engine thread owns it), read at
    scrape time: no second count to keep in step, and it never goes down."""

    def __init__(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self._name, self._doc, self._read = name, doc, read

    def collect(self):
        yield CounterMetricFamily(self._name, self._doc, value=self._read())


class PushMetrics:
    """The push sender's observer (transfer/sender.py ``PushObserver``): rooms by outcome,
    bytes written to receivers, and the time from the first byte offered to the last ack."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rooms = Counter("epd_push_rooms", "Push rooms ended, by outcome ('done' or the error code)",
                             ["outcome"], registry=registry)
        self.bytes = Counter("epd_push_bytes", "Embedding bytes written to push receivers (per target)",
                             registry=registry)
        self.transfer_s = Histogram("epd_push_transfer_seconds",
                                    "Delivered rooms: outputs handed to the sender to every target's ack",
                                    buckets=_LATENCY, registry=registry)

    def room_ended(self, outcome: str, transfer_s: float | None) -> None:
        self.rooms.labels(outcome).inc()
        if transfer_s is not None:
            self.transfer_s.observe(transfer_s)

    def bytes_sent(self, n: int) -> None:
        self.bytes.inc(n)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # process_* (RSS, fds, CPU) and python_* (GC, version) on this registry, not the global one.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter("epd_requests", "Finished HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.request_s = Histogram("epd_request_duration_seconds",
                                   "HTTP request, head received to response sent, by route template",
                                   ["route", "method", "status_class"], buckets=_LATENCY, registry=r)
        self.items = Counter("epd_items", "Delivered items by cache state", ["cache"], registry=r)
        self.bytes_out = Counter("epd_bytes_out", "Embedding bytes sent to clients", registry=r)
        self.batch_size = Histogram("epd_batch_items", "Items per vision forward",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_fill = Histogram("epd_batch_fill_ratio", "Batch cost / budget",
                                    buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0), registry=r)
        self.queue_s = Histogram("epd_queue_seconds", "Submit to forward start, per item",
                                 buckets=_LATENCY, registry=r)
        self.preprocess_s = Histogram("epd_preprocess_seconds", "Decode + preprocess, per item",
                                      buckets=_LATENCY, registry=r)
        self.forward_s = Histogram("epd_forward_seconds", "Vision forward, per batch",
                                   buckets=_LATENCY, registry=r)
        self.delivery_s = Histogram("epd_delivery_seconds", "Serialize and send, per request",
                                    buckets=_LATENCY, registry=r)
        self.queue_depth = Gauge("epd_queued_items", "Items waiting for a forward", registry=r)
        self.pending_cost = Gauge("epd_pending_cost_patches",
                                  "Pre-merge patches of accepted, unfinished work", registry=r)
        self.push = PushMetrics(r)
        self._shared: Any = None

    def bind(self, *, cache: Any, queue_depth: Callable[[], float], pending_cost: Callable[[], float],
             coalesced: Callable[[], float]) -> None:
        """Attach the live sources read at scrape time (``coalesced`` is cumulative)."""
        self.registry.register(_CacheCollector(cache, lambda: self._shared))
        self.registry.register(_CumulativeCounter("epd_coalesced", "Items that joined an in-flight encode",
                                                  coalesced))
        self.queue_depth.set_function(queue_depth)
        self.pending_cost.set_function(pending_cost)

    def bind_shared(self, tier: Any) -> None:
        """Attach the shared tier (cache/shared.py SharedTier)."""
        self._shared = tier
        self.registry.register(_SharedCacheCollector(tier))

    def observe_request(self, route: str, method: str, status: int, started: float) -> None:
        """One finished request; ``started`` is a ``time.perf_counter()`` reading."""
        self.requests.labels(route, str(status)).inc()
        method = method if method in _METHODS else "other"  # clients choose it: keep it bounded
        self.request_s.labels(route, method, f"{status // 100}xx").observe(time.perf_counter() - started)

    def render(self) -> bytes:
        return generate_latest(self.registry)
