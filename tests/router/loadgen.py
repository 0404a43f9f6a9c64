# SPDX-License-Identifier: Apache-2.0
"""A closed-loop load of real HTTP clients (threads), each recording every request's one outcome.

Used by the fault tests and benchmarks/bench_fleet.py. A request is a list of image ids; its
bytes come from ``image(id)``, so an id names one content everywhere. Each client sends its next
request when its last one has been answered (or has failed), until ``stop`` is set or it has sent
``requests`` requests. Every outcome keeps the per-item metadata of an inline answer as the
server wrote it (``key``, ``cache`` and, on hits, ``tier``).
"""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import numpy as np
from PIL import Image


def png(image_id: int, size: tuple[int, int] = (64, 96)) -> bytes:
    """Seeded noise: one content per id (PNG is lossless, so keys differ per id)."""
    rng = np.random.default_rng(image_id)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def body(ids: list[int], image: Callable[[int], bytes] = png) -> dict:
    return {"items": [{"type": "image", "image": base64.b64encode(image(i)).decode()} for i in ids]}


def inline_items(content: bytes) -> list[dict]:
    """The per-item metadata JSON of an inline (safetensors) body, unknown fields included."""
    (n,) = struct.unpack("<Q", content[:8])
    header = json.loads(content[8:8 + n])
    return json.loads(header["__metadata__"]["items"])


@dataclass
class Outcome:
    client: int
    ids: list[int]
    start: float
    end: float = 0.0
    status: int | None = None  # None: no HTTP answer (transport error or client timeout)
    error: str = ""
    items: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and len(self.items) == len(self.ids)


def encode(client: httpx.Client, ids: list[int], who: int = 0, image: Callable[[int], bytes] = png) -> Outcome:
    out = Outcome(who, ids, time.monotonic())
    try:
        r = client.post("/v1/encode", json=body(ids, image))
        out.status = r.status_code
        if r.status_code == 200:
            out.items = inline_items(r.content)
        else:
            out.error = r.text[:300]
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.end = time.monotonic()
    return out


@dataclass
class Load:
    outcomes: list[Outcome]
    hung: int  # clients still waiting on an answer ``timeout`` + 5 s after the load was stopped


def closed_loop(url: str | list[str], clients: int, next_ids: Callable[[int, int], list[int]], *,
                stop: threading.Event | None = None, requests: int | None = None,
                timeout: float = 30.0, image: Callable[[int], bytes] = png,
                on_answer: Callable[[Outcome], None] | None = None,
                pick: Callable[[], int] | None = None) -> Load:
    """Run ``clients`` loops; ``next_ids(client, n)`` is client's n-th request. With several
    URLs each request goes to ``url[pick() % len(url)]`` (``pick``: a shared counter, say).
    With ``stop``, the caller sets it (from ``on_answer`` or another thread) and this returns once
    every client has its last answer, or ``timeout`` + 5 s after stop with the rest counted hung;
    with ``requests``, each client sends that many."""
    assert (stop is None) != (requests is None)
    urls = [url] if isinstance(url, str) else url
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def run(who: int) -> None:
        conns = [httpx.Client(base_url=u, timeout=timeout) for u in urls]
        try:
            n = 0
            while not (stop is not None and stop.is_set()) and (requests is None or n < requests):
                c = conns[pick() % len(conns)] if pick is not None else conns[0]
                o = encode(c, next_ids(who, n), who, image)
                with lock:
                    outcomes.append(o)
                if on_answer is not None:
                    on_answer(o)
                n += 1
        finally:
            for c in conns:
                c.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    if stop is not None:
        stop.wait()
        deadline = time.monotonic() + timeout + 5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    else:
        for t in threads:
            t.join()
    with lock:
        return Load(list(outcomes), sum(t.is_alive() for t in threads))


class ZipfPool:
    """Image ids drawn by Zipf(``s``) over a pool of ``pool`` ids (rank 1 the hottest), seeded."""

    def __init__(self, pool: int, s: float = 1.0, seed: int = 0, base: int = 0) -> None:
        w = 1.0 / np.arange(1, pool + 1) ** s
        self.cdf = np.cumsum(w / w.sum())
        self.base, self.rng = base, np.random.default_rng(seed)
        self.lock = threading.Lock()

    def draw(self) -> int:
        with self.lock:
            u = self.rng.random()
        return self.base + int(np.searchsorted(self.cdf, u, side="right"))
