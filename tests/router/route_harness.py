# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder route`` as a real subprocess (its Envoy under it), a status stub server, and
module fixtures (import them into a test module): a tiny checkpoint, three real encode servers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from epd_encoder.models.tiny import write_tiny_model
from tests.e2e.harness import Server, scrape, serve_config


def envoy_or_skip() -> str:
    from epd_encoder.router.envoy import EnvoyMissing, find_envoy

    try:
        return find_envoy()
    except EnvoyMissing as e:
        pytest.skip(f"{e} (make install installs it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    """The command as a user runs it; ``envoy`` is Envoy's own listener, ``admin`` its admin."""

    def __init__(self, *flags: str, log: Path) -> None:
        self.port, self.envoy_port, self.admin_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.envoy = f"http://127.0.0.1:{self.envoy_port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.log = log
        argv = [sys.executable, "-m", "epd_encoder.cli", "route", "--port", str(self.port),
                "--envoy-port", str(self.envoy_port), "--admin-port", str(self.admin_port),
                "--envoy-concurrency", "1", "--health-interval", "0.5", "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def healthy_servers(self) -> int:
        try:
            r = httpx.get(self.url + "/health", timeout=5)
        except httpx.HTTPError:
            return -1
        return r.json().get("healthy_servers", 0) if r.status_code == 200 else 0

    def wait_healthy(self, n: int, timeout: float = 60) -> "Router":
        deadline = time.monotonic() + timeout
        while self.healthy_servers() != n:
            if self.proc.poll() is not None:
                raise RuntimeError(f"route exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"route never saw {n} healthy servers: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        return self

    def routes(self, keys: int = 20) -> list[str]:
        """The server Envoy picks for each of ``keys`` probe keys (its session header)."""
        return [httpx.get(self.envoy + "/info", headers={"x-epd-routing-key": f"probe-{k}"},
                          timeout=10).headers.get("x-epd-upstream", "") for k in range(keys)]

    def settle(self, n: int, timeout: float = 30) -> "Router":
        """Wait until Envoy's choices cover ``n`` servers and hold for two sweeps: a member
        Envoy reports healthy may take its first work a few seconds later (docs/router.md)."""
        deadline, last = time.monotonic() + timeout, None
        while True:
            now = self.routes()
            if now == last and len(set(now)) == n:
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"routing did not settle over {n} servers: {now}")
            last = now

    def answers(self) -> bool:
        """A GET through Envoy reaches some server."""
        return httpx.get(self.url + "/info", timeout=10).status_code == 200

    def hosts(self) -> dict[str, str]:
        """Envoy's members, ``{"127.0.0.1:PORT": health_flags}`` ("healthy" when none is set)."""
        text = httpx.get(self.admin + "/clusters", timeout=5).text
        return {p[1]: p[3] for p in (line.split("::") for line in text.splitlines())
                if len(p) == 4 and p[2] == "health_flags"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


STUB = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
status, posts = int(sys.argv[2]), 0
codes = {429: "overloaded", 503: "not_ready"}
BODY = json.dumps({"error": {"code": codes[status], "message": "stub"}}).encode()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, code, body):
        self.send_response(code); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        self._send(200, json.dumps({"status": "ok", "posts": posts}).encode())
    def do_POST(self):
        global posts
        self.rfile.read(int(self.headers.get("content-length") or 0)); posts += 1
        self._send(status, BODY)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


class Stub:
    """A process healthy on every GET that answers every POST with ``status`` (429 or 503),
    in the server's error shape, and counts the POSTs."""

    def __init__(self, status: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-c", STUB, str(self.port), str(status)])
        deadline = time.monotonic() + 20
        while True:
            try:
                self.posts()
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def posts(self) -> int:
        return int(httpx.get(self.url + "/health", timeout=5).json()["posts"])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def servers(tiny_dir):
    envoy_or_skip()
    fleet = [Server(serve_config(tiny_dir)).start() for _ in range(3)]
    yield fleet
    for s in fleet:
        s.stop()


def served(server: Server) -> float:
    """Items this server has delivered, any cache state (its own ``epd_items_total``)."""
    with httpx.Client(base_url=server.url, timeout=10) as c:
        return sum(v for (name, _), v in scrape(c).items() if name == "epd_items_total")
