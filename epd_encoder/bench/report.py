# SPDX-License-Identifier: Apache-2.0
"""Results: ``results.json`` (schema ``SCHEMA``), ``results.png`` and the printed table.

The JSON (docs/bench.md, "Output") is ``{"schema", "created", "command", "machine",
"workload", "runs": [target...], "ratios": {baseline: [per point]}}``; each target's
``points`` hold ``load``, ``requests``, ``wall_s``, ``throughput``, ``latency_ms``
(``metadata`` / ``embeddings``: p50, p90, p99, mean, max), ``errors`` (by status),
``error_codes``, ``client_cache`` and ``server`` (scrape.py's deltas, or null).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

SCHEMA = "epd-encoder-bench/v1"
POINT_KEYS = ("load", "requests", "wall_s", "throughput", "latency_ms", "errors", "error_codes",
              "client_cache", "server")


def document(runs: list[dict], ratios: dict[str, list[dict]], **context: Any) -> dict:
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **context,
            "runs": runs, "ratios": ratios}


def check(doc: dict) -> None:
    """Raise ValueError if ``doc`` lacks what the schema promises (tests and readers use it)."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"schema is {doc.get('schema')!r}, not {SCHEMA!r}")
    for run in doc["runs"]:
        for key in ("name", "url", "delivery", "points"):
            if key not in run:
                raise ValueError(f"run {run.get('name')!r} lacks {key!r}")
        for p in run["points"]:
            missing = [k for k in POINT_KEYS if k not in p]
            if missing:
                raise ValueError(f"run {run['name']!r}: a point lacks {missing}")
            for which in ("metadata", "embeddings"):
                if not {"p50", "p90", "p99"} <= set(p["latency_ms"][which]):
                    raise ValueError(f"run {run['name']!r}: latency_ms.{which} lacks p50/p90/p99")
    for name, per_point in doc["ratios"].items():
        for r in per_point:
            if not {"load", "throughput", "p99_embeddings"} <= set(r):
                raise ValueError(f"ratios[{name!r}] lacks throughput / p99_embeddings")


def write_json(doc: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(doc, indent=2, allow_nan=False, default=str) + "\n")
    return path


def _x(run: dict) -> tuple[list[float], str]:
    loads = [p["load"] for p in run["points"]]
    mode = loads[0]["mode"] if loads else "concurrency"
    label = {"concurrency": "concurrency (clients)", "rate": "offered rate (requests/s)"}.get(mode, "load")
    return [float(lo["value"]) for lo in loads], label


def write_png(doc: dict, out_dir: Path, warn: Callable[[str], None] = print) -> Path | None:
    """Latency (p50, p99 to embeddings) and throughput against load; None, with a warning,
    when matplotlib (the ``bench`` extra) is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn("no PNG: matplotlib is not installed (pip install 'epd-encoder[bench]')")
        return None
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in doc["runs"]:
        xs, label = _x(run)
        emb = [p["latency_ms"]["embeddings"] for p in run["points"]]
        line, = lat.plot(xs, [e["p99"] or float("nan") for e in emb], marker="o", label=f"{run['name']} p99")
        lat.plot(xs, [e["p50"] or float("nan") for e in emb], marker=".", linestyle="--", color=line.get_color(),
                 label=f"{run['name']} p50")
        thr.plot(xs, [p["throughput"]["items_per_s"] for p in run["points"]], marker="o", label=run["name"])
        lat.set_xlabel(label)
        thr.set_xlabel(label)
    lat.set_ylabel("latency to embeddings (ms)")
    thr.set_ylabel("throughput (images + videos / s)")
    lat.set_title("latency vs load")
    thr.set_title("throughput vs load")
    for ax in (lat, thr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def table(doc: dict) -> str:
    """One line per target and point, then the ratios."""
    head = (f"{'target':<12} {'load':>8} {'ok':>5} {'err':>4} {'req/s':>7} {'img/s':>7} "
            f"{'meta p50/p90/p99 ms':>22} {'emb p50/p90/p99 ms':>22} {'hit':>5} {'coal':>5} {'batch':>6} {'fill':>5}")
    lines = [head, "-" * len(head)]
    for run in doc["runs"]:
        for p in run["points"]:
            lo, t, lat, s = p["load"], p["throughput"], p["latency_ms"], p["server"] or {}
            load = {"concurrency": f"c={lo['value']:g}", "rate": f"{lo['value']:g}/s"}.get(lo["mode"], lo["mode"])
            meta, emb = (lat[k] for k in ("metadata", "embeddings"))
            batch = s.get("batch_items_mean")
            lines.append(
                f"{run['name']:<12} {load:>8} {p['requests']['ok']:>5} {p['requests']['failed']:>4} "
                f"{t['requests_per_s']:>7.2f} {t['items_per_s']:>7.2f} "
                f"{'/'.join(_ms(meta[q]) for q in ('p50', 'p90', 'p99')):>22} "
                f"{'/'.join(_ms(emb[q]) for q in ('p50', 'p90', 'p99')):>22} "
                f"{_pct(s.get('hit_rate')):>5} {_pct(s.get('coalesced_rate')):>5} "
                f"{'-' if batch is None else f'{batch:.2f}':>6} {_pct(s.get('batch_fill_mean')):>5}")
            if p["errors"]:
                lines.append(f"{'':<12} errors by status: {p['errors']}")
    for name, per_point in doc["ratios"].items():
        for r in per_point:
            lo = r["load"]
            tr = "-" if r["throughput"] is None else f"{r['throughput']:.2f}x"
            pr = "-" if r["p99_embeddings"] is None else f"{r['p99_embeddings']:.2f}x"
            lines.append(f"ours/{name} at {lo['mode']} {lo['value']:g}: throughput {tr} (above 1: ours faster), "
                         f"p99 {pr} (below 1: ours lower)")
    return "\n".join(lines)
