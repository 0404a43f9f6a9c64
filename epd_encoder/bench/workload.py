# SPDX-License-Identifier: Apache-2.0
"""What each request of a run carries: planned here, rendered to bytes by media.py.

A plan is a pure function of ``(WorkloadSpec, seed, namespace, n)``: every target of a
run (ours, each baseline) gets the same requests at the same load point. Each load point
of a sweep gets its own namespace, so its unique images are unique on a server that
already ran the previous points; duplicates repeat only within a point.

Duplicates: each item repeats an earlier item of the point with probability
``duplicate_rate``. The repeated one is drawn by Zipf(``zipf_s``) over the first
``pool_size`` distinct media emitted (rank 1, the first emitted, is the hottest); other
items are new media. So the fraction of items that repeat earlier content is
``duplicate_rate`` from the second item on, whatever the pool size.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

import numpy as np

Kind = Literal["image", "video"]
VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi"})


@dataclass(frozen=True)
class SizeChoice:
    """``WxH`` (fixed), or a range ``LO-HI`` whose width and height are each drawn in it."""

    lo: tuple[int, int]
    hi: tuple[int, int]
    weight: float = 1.0

    def label(self) -> str:
        return f"{self.lo[0]}x{self.lo[1]}" if self.lo == self.hi else f"{self.lo[0]}-{self.hi[0]}"


@dataclass(frozen=True)
class Media:
    """One item's content: rendered from ``(namespace, index)`` or read from ``ref``.

    ``ref`` (a trace's path or URL) wins over generation; ``index`` alone names the
    content, so two items with equal ``(namespace, index)`` are byte-identical.
    """

    kind: Kind
    namespace: int
    index: int
    width: int = 0
    height: int = 0
    ref: str | None = None


@dataclass(frozen=True)
class PlannedRequest:
    items: tuple[Media, ...]
    at: float | None = None  # seconds from the start (a trace's timestamp); None: the loop decides

    @property
    def images(self) -> int:
        return sum(m.kind == "image" for m in self.items)

    @property
    def videos(self) -> int:
        return sum(m.kind == "video" for m in self.items)


@dataclass(frozen=True)
class WorkloadSpec:
    sizes: tuple[SizeChoice, ...] = field(default_factory=lambda: parse_sizes("448x448"))
    images_per_request: int = 1
    duplicate_rate: float = 0.0
    pool_size: int = 1000
    zipf_s: float = 1.1
    video_share: float = 0.0  # fraction of items that are videos

    def __post_init__(self) -> None:
        if not 0 <= self.duplicate_rate <= 1 or not 0 <= self.video_share <= 1:
            raise ValueError("--duplicate-rate and --video-share are fractions in [0, 1]")
        if self.images_per_request < 1 or self.pool_size < 1 or self.zipf_s <= 0:
            raise ValueError("--images-per-request and --pool-size must be >= 1, --zipf-s > 0")


_SIZE = re.compile(r"^(?:(\d+)x(\d+)|(\d+)-(\d+))(?::([0-9.]+))?$")


def parse_sizes(text: str) -> tuple[SizeChoice, ...]:
    """``448x448,1024x1024:2,112-448``: sizes with optional weights (default 1)."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = _SIZE.match(part)
        if not m:
            raise ValueError(f"--image-sizes: {part!r} is not WxH[:weight] or LO-HI[:weight]")
        w = float(m[5]) if m[5] else 1.0
        if m[1]:
            size = (int(m[1]), int(m[2]))
            out.append(SizeChoice(size, size, w))
        else:
            lo, hi = sorted((int(m[3]), int(m[4])))
            out.append(SizeChoice((lo, lo), (hi, hi), w))
        if min(out[-1].lo) < 1 or w <= 0:
            raise ValueError(f"--image-sizes: {part!r} needs positive sizes and weight")
    if not out:
        raise ValueError("--image-sizes is empty")
    return tuple(out)


class Zipf:
    """Bounded Zipf over ranks 1..n (n may grow up to ``limit``): P(k) ∝ k^-s."""

    def __init__(self, s: float, limit: int) -> None:
        self._cum = np.cumsum(np.arange(1, limit + 1, dtype=np.float64) ** -s)

    def draw(self, rng: np.random.Generator, n: int) -> int:
        """A 0-based rank below ``n``."""
        u = rng.random() * self._cum[n - 1]
        return min(bisect.bisect_right(self._cum, u, 0, n), n - 1)


def plan(spec: WorkloadSpec, seed: int, namespace: int, n: int) -> list[PlannedRequest]:
    """The first ``n`` requests of ``iter_plan``."""
    return list(itertools.islice(iter_plan(spec, seed, namespace), n))


def iter_plan(spec: WorkloadSpec, seed: int, namespace: int) -> Iterator[PlannedRequest]:
    """Requests of ``spec`` without end; deterministic in ``(seed, namespace)``."""
    rng = np.random.default_rng([seed, namespace])
    zipf = Zipf(spec.zipf_s, spec.pool_size)
    weights = np.array([c.weight for c in spec.sizes])
    weights /= weights.sum()
    emitted: list[Media] = []  # the pool: the first pool_size distinct media
    fresh = itertools.count()
    while True:
        items = []
        for _ in range(spec.images_per_request):
            if emitted and rng.random() < spec.duplicate_rate:
                items.append(emitted[zipf.draw(rng, min(len(emitted), spec.pool_size))])
                continue
            if rng.random() < spec.video_share:
                media = Media("video", namespace, next(fresh))
            else:
                c = spec.sizes[int(rng.choice(len(spec.sizes), p=weights))]
                w, h = (int(rng.integers(c.lo[i], c.hi[i] + 1)) for i in (0, 1))
                media = Media("image", namespace, next(fresh), w, h)
            if len(emitted) < spec.pool_size:
                emitted.append(media)
            items.append(media)
        yield PlannedRequest(tuple(items))


def duplicate_fraction(requests: list[PlannedRequest]) -> float:
    """Items whose content appeared earlier in ``requests``, over all items after the first."""
    seen: set[tuple] = set()
    repeats = total = 0
    for r in requests:
        for m in r.items:
            key = (m.kind, m.namespace, m.index, m.ref)
            if total:
                repeats += key in seen
            seen.add(key)
            total += 1
    return repeats / (total - 1) if total > 1 else 0.0


def poisson_arrivals(rate: float, rng: np.random.Generator, *, n: int | None = None,
                     duration: float | None = None) -> list[float]:
    """Arrival times (s from 0) of a Poisson process of ``rate``/s: ``n`` of them, or all before ``duration``."""
    if rate <= 0 or (n is None) == (duration is None):
        raise ValueError("need rate > 0 and exactly one of n, duration")
    if n is not None:
        return np.cumsum(rng.exponential(1 / rate, n)).tolist()
    out: list[float] = []
    t = 0.0
    assert duration is not None
    while True:
        t += float(rng.exponential(1 / rate))
        if t >= duration:
            return out
        out.append(t)


def load_trace(path: str | Path) -> list[PlannedRequest]:
    """A JSONL trace: one request per line, ``{"timestamp": s, "media": [ref, ...]}``.

    A ref is a path (relative to the trace's folder) or an http(s) URL; a string is a
    video by its suffix (.mp4 .mov .webm .mkv .avi), an image otherwise; an object
    ``{"type": "image"|"video", "ref": ...}`` says so itself. Timestamps are seconds,
    shifted so the first request is at 0; lines are replayed in timestamp order.
    """
    base = Path(path).parent
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts = float(row["timestamp"])
                refs = row["media"]
                if not math.isfinite(ts) or not isinstance(refs, list) or not refs:
                    raise ValueError("timestamp must be finite and media a non-empty list")
                items = tuple(_trace_media(ref, base) for ref in refs)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
            rows.append((ts, items))
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [PlannedRequest(items, at=ts - t0) for ts, items in rows]


def _trace_media(ref: object, base: Path) -> Media:
    kind: str | None = None
    if isinstance(ref, dict):
        kind, ref = ref.get("type"), ref.get("ref")
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"a media reference must be a non-empty string, got {ref!r}")
    if not ref.startswith(("http://", "https://")):
        ref = str((base / ref).resolve()) if not Path(ref).is_absolute() else ref
    kind = kind or ("video" if Path(ref.split("?")[0]).suffix.lower() in VIDEO_SUFFIXES else "image")
    if kind not in ("image", "video"):
        raise ValueError(f"media type must be image or video, got {kind!r}")
    return Media(kind, 0, -1, ref=ref)  # type: ignore[arg-type]
