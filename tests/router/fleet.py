# SPDX-License-Identifier: Apache-2.0
"""A fleet on loopback as real processes, for the fault tests and benchmarks/bench_fleet.py.

- ``Child``: one child process in its own session, output to a log file, signalled by its pid only.
- ``Serve``: ``epd-encoder serve`` on a fixed port, so a restart comes back at the address the
  router already knows (Envoy's membership is the address, not the process).
- ``Master``: ``mooncake_master`` with its HTTP metadata server, the shared tier's store.
- ``StoreNode``: ``mooncake_client`` lending memory to that store, apart from the servers.
- ``Route``: ``epd-encoder route`` with one ``--backend`` per member; reads Envoy's admin.
- ``Stub429``: a plain HTTP server that is healthy but answers every encode with our 429 body,
  and counts them: a server at its pending-work bound, made deterministic.
- ``running(*stages)``: stage by stage, ready within one deadline, every child closed after.
Every wait polls with a deadline; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx

ROOT = Path(__file__).resolve().parents[2]
START_S = 120.0  # several servers importing torch at once on two busy cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(cond: Callable[[], bool], timeout: float, every: float = 0.05) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def answers(url: str, path: str = "/health", timeout: float = 1.0) -> bool:
    try:
        return httpx.get(url + path, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


class Child:
    """A child process; ``argv`` is fixed so ``start`` can run it again after a kill."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log = name, argv, log
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_ENCODER_")}
        self.env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Child":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:  # overridden: when the child serves
        return self.alive

    def wait_ready(self, deadline: float) -> None:
        while not self.ready():
            if not self.alive or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not become ready:\n{self.tail()}")
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL and reap (a SIGSTOPped child dies too)."""
        if self.alive:
            self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def close(self, grace: float = 10.0) -> None:
        if not self.alive:
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Serve(Child):
    def __init__(self, name: str, model: Path, log: Path, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(name, [sys.executable, "-m", "epd_encoder.cli", "serve", "--model", str(model),
                                "--model-id", "tiny", "--port", str(self.port), *flags], log)

    def ready(self) -> bool:
        return self.alive and answers(self.url)


class Master(Child):
    """``mooncake_master`` on loopback; ``address`` is what ``--shared-cache mooncake://`` takes."""

    def __init__(self, log: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        super().__init__("mooncake_master", [master_exe() or "mooncake_master", f"-rpc_port={self.port}",
                                             "-enable_http_metadata_server=true",
                                             f"-http_metadata_server_port={self.http_port}",
                                             f"-metrics_port={free_port()}"], log)

    @property
    def url(self) -> str:
        return f"mooncake://{self.address}?metadata={self.metadata}"

    def ready(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return self.alive
        except OSError:
            return False


class StoreNode(Child):
    """``mooncake_client``: a store node lending ``segment`` of its memory to the master's store,
    so entries outlive any encode server (which then lend none: ``--shared-cache-segment-mb 0``)."""

    def __init__(self, master: Master, log: Path, segment: str = "256MB") -> None:
        self.http_port = free_port()
        exe = str(Path(master.argv[0]).with_name("mooncake_client"))
        super().__init__("mooncake_client", [exe, f"-master_server_address={master.address}",
                                             f"-metadata_server={master.metadata}", "-host=127.0.0.1",
                                             f"-port={free_port()}", "-protocol=tcp",
                                             f"-global_segment_size={segment}", "-local_buffer_size=16MB",
                                             "-enable_http_server=true", f"-http_port={self.http_port}"], log)

    def ready(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.http_port), timeout=1).close()
            return self.alive
        except OSError:
            return False


def master_exe() -> str | None:
    exe = shutil.which("mooncake_master") or str(Path(sys.executable).with_name("mooncake_master"))
    return exe if Path(exe).exists() else None


def fleet_missing(shared: bool = True) -> str | None:
    """Why a fleet cannot run here, or None: no Envoy; with ``shared``, no Mooncake Store
    (its master, or the client binding the servers load)."""
    try:
        from epd_encoder.router.envoy import EnvoyMissing, find_envoy
    except ImportError:
        return "epd_encoder.router is not built"
    try:
        find_envoy()
    except EnvoyMissing as e:
        return str(e)
    if not shared:
        return None
    if master_exe() is None:
        return "mooncake_master is not installed (pip install 'epd-encoder[mooncake]')"
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return "mooncake.store is not importable"
    return None


class Route(Child):
    """``epd-encoder route``; Envoy's admin interface on a known port, to read what Envoy thinks."""

    def __init__(self, name: str, backends: list[str], log: Path, *flags: str) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        argv = [sys.executable, "-m", "epd_encoder.cli", "route", "--port", str(self.port),
                "--admin-port", str(self.admin_port)]
        for b in backends:
            argv += ["--backend", b]
        super().__init__(name, [*argv, *flags], log)

    def ready(self) -> bool:
        return self.alive and answers(self.url)

    def hosts(self) -> dict[str, str]:
        """``{"127.0.0.1:PORT": health_flags}`` of every upstream Envoy knows ("healthy" when
        none is set; else e.g. "/failed_active_hc" or "/failed_outlier_check")."""
        text = httpx.get(self.admin + "/clusters", timeout=5).text
        out = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[2] == "health_flags":
                out[parts[1]] = parts[3]
        return out

    def healthy(self, url: str) -> bool:
        return self.hosts().get(url.removeprefix("http://")) == "healthy"

    def stat(self, name: str) -> int:
        """The sum of Envoy counters whose name ends with ``name`` (e.g. ``upstream_rq_retry``)."""
        text = httpx.get(self.admin + "/stats", params={"filter": name}, timeout=5).text
        return sum(int(v) for k, _, v in (line.partition(": ") for line in text.splitlines())
                   if k.endswith(name) and v.strip().isdigit())


STUB = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
count = 0
BODY = json.dumps({"error": {"code": "overloaded", "message": "stub at its bound"}}).encode()
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, code, body):
        self.send_response(code); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        self._send(200, json.dumps({"status": "ok", "encodes": count}).encode())
    def do_POST(self):
        global count
        self.rfile.read(int(self.headers.get("content-length") or 0)); count += 1
        self._send(429, BODY)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


class Stub429(Child):
    """Healthy on every GET (``/health`` too); every POST is a 429 ``overloaded``, counted."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__("stub429", [sys.executable, "-c", STUB, str(self.port)], log)

    def ready(self) -> bool:
        return self.alive and answers(self.url)

    def encodes(self) -> int:
        return int(httpx.get(self.url + "/health", timeout=5).json()["encodes"])


@contextlib.contextmanager
def running(*stages: list[Child], start_s: float = START_S) -> Iterator[None]:
    """Start each stage's children together, the next stage once they are ready (the master before
    the servers that connect to it, the servers before the router), all within ``start_s``; every
    child closed after, whatever happens."""
    started: list[Child] = []
    try:
        deadline = time.monotonic() + start_s
        for stage in stages:
            for c in stage:
                started.append(c.start())
            for c in stage:
                c.wait_ready(deadline)
        yield
    finally:
        for c in reversed(started):
            c.close()
