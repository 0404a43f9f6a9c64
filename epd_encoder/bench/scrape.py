# SPDX-License-Identifier: Apache-2.0
"""What the server says about a load point: ``/metrics`` before and after, as deltas.

Read: ``epd_items_total{cache}`` (delivered items by hit / miss / coalesced),
``epd_coalesced_total``, and the ``epd_batch_items`` and ``epd_batch_fill_ratio``
histograms (sum and count: mean batch size and mean fill, cost over budget) plus
``epd_forward_seconds``. A server without our metrics (a baseline) gives ``None``.
"""

from __future__ import annotations

from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


class MetricsReader(Protocol):
    async def __call__(self) -> Samples | None: ...


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def scrape(client: httpx.AsyncClient) -> Samples | None:
    """Every sample of ``/metrics``; None when the server has no (Prometheus) ``/metrics``."""
    try:
        r = await client.get("/metrics")
        if r.status_code != 200:
            return None
        samples = parse(r.text)
    except (httpx.HTTPError, ValueError):
        return None
    return samples if any(name.startswith("epd_") for name, _ in samples) else None


def _get(s: Samples, name: str, **labels: str) -> float:
    return s.get((name, frozenset(labels.items())), 0.0)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def server_delta(before: Samples | None, after: Samples | None) -> dict | None:
    """The point's server-side numbers; None if either scrape failed."""
    if before is None or after is None:
        return None

    def d(name: str, **labels: str) -> float:
        return _get(after, name, **labels) - _get(before, name, **labels)

    items = {c: d("epd_items_total", cache=c) for c in ("hit", "miss", "coalesced")}
    total = sum(items.values())
    batches = d("epd_batch_items_count")
    return {
        "items": items,
        "hit_rate": _ratio(items["hit"], total),
        "coalesced_rate": _ratio(items["coalesced"], total),
        "coalesced_total": d("epd_coalesced_total"),
        "batches": batches,
        "batch_items_mean": _ratio(d("epd_batch_items_sum"), batches),
        "batch_fill_mean": _ratio(d("epd_batch_fill_ratio_sum"), d("epd_batch_fill_ratio_count")),
        "forward_s_total": d("epd_forward_seconds_sum"),
    }
