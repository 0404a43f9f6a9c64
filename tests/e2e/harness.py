# SPDX-License-Identifier: Apache-2.0
"""A real uvicorn server on loopback, in a thread, for end-to-end tests."""

from __future__ import annotations

import base64
import contextlib
import io
import threading
import time
from dataclasses import replace

import httpx
import numpy as np
import uvicorn
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from epd_encoder.api.app import create_app
from epd_encoder.config import ServeConfig
from epd_encoder.server.http import uvicorn_config
from epd_encoder.server.runtime import Runtime


class Server:
    def __init__(self, config: ServeConfig, make_runtime=Runtime) -> None:
        self.app = create_app(config, make_runtime)
        self.state = self.app.state.epd
        cfg = uvicorn_config(self.app, config, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def runtime(self) -> Runtime:
        return self.state.runtime

    def start(self, wait_ready: bool = True) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and self.server.servers):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        while wait_ready and self.runtime is None:
            if time.monotonic() > deadline or self.state.failed:
                raise RuntimeError(f"runtime did not load: {self.state.failed}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    @contextlib.contextmanager
    def paused_engine(self):
        """Hold the engine thread (as a long forward would) until the block exits."""
        gate, holding = threading.Event(), threading.Event()

        def hold(_worker):
            holding.set()
            gate.wait(30)

        self.runtime.engine.call(hold)
        assert holding.wait(10)
        try:
            yield
        finally:
            gate.set()

    @contextlib.contextmanager
    def held_forward(self):
        """Hold every vision forward at its start until the block exits; yields the
        Event set once a forward is waiting. Work queued behind it stays queued."""
        executor, gate, entered = self.runtime.executor, threading.Event(), threading.Event()
        real = executor.encode

        def held(items):
            entered.set()
            gate.wait(30)
            return real(items)

        executor.encode = held
        try:
            yield entered
        finally:
            executor.encode = real
            gate.set()


def serve_config(model_dir, **overrides) -> ServeConfig:
    base = ServeConfig()
    model = replace(base.model, model=str(model_dir), model_id="tiny-test")
    return replace(base, model=model, **overrides)


def png(seed: int, size=(96, 128)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def flat_png(seed: int, size=(448, 448)) -> bytes:
    """A one-colour PNG (distinct per seed below 65536): full-size items for a few KiB of body."""
    buf = io.BytesIO()
    Image.new("RGB", size[::-1], (seed % 256, seed // 256 % 256, 7)).save(buf, "PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def body(*images: bytes, **extra) -> dict:
    return {"items": [{"type": "image", "image": b64(i)} for i in images], **extra}


def wait_for(cond, timeout: float = 20.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` passes; the deadline is generous for loaded CPUs."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


Scrape = dict[tuple[str, frozenset], float]


def scrape(client: httpx.Client) -> Scrape:
    """Every sample of ``/metrics``, keyed by (sample name, frozenset of its labels)."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def metric(source: "httpx.Client | Scrape", name: str, **labels) -> float:
    """One sample's value; a series that is not exported fails the test (it never reads as 0)."""
    samples = source if isinstance(source, dict) else scrape(source)
    key = (name, frozenset((k, str(v)) for k, v in labels.items()))
    if key not in samples:
        near = sorted({f"{n}{dict(lb)}" for n, lb in samples if n == name})
        raise AssertionError(f"metric {name}{labels} is not exported; {name} has {near or 'no series'}")
    return samples[key]


def delta(client: httpx.Client, before: Scrape, name: str, **labels) -> float:
    """How far a counter moved since ``before``. It must be exported now; absent before
    means not yet touched (a labelled Prometheus child appears on its first increment)."""
    key = (name, frozenset((k, str(v)) for k, v in labels.items()))
    return metric(client, name, **labels) - before.get(key, 0.0)
