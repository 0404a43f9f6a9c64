# SPDX-License-Identifier: Apache-2.0
"""Helpers for hostile-client tests: raw sockets and a /health latency probe."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import httpx

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def connect(url: str, timeout: float = 5.0) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# A head that declares a body, and the first bytes of that body; the rest is to be trickled.
BODIES = {
    "chunked": (b"Transfer-Encoding: chunked\r\n", b"4\r\nabcd\r\n", b"1\r\nx\r\n" * 400),
    "content-length": (b"Content-Length: 100000\r\n", b"abcd", b"x" * 400),
}


def open_with_body(url: str, method: bytes, kind: str, path: bytes = b"/health") -> socket.socket:
    """A connection that has sent ``method path`` with a ``kind`` body (see BODIES) begun."""
    header, first, _ = BODIES[kind]
    sock = connect(url)
    sock.sendall(method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n" + first)
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout: float) -> tuple[bytes, bool]:
    """Bytes up to and including ``marker``, read one at a time so nothing after it is consumed;
    False if the peer closed first. Each receive waits at most ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    while marker not in data:
        chunk = sock.recv(1)
        if not chunk:
            return data, False
        data += chunk
    return data, True


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float | None]:
    """Everything the server sends until it closes; the seconds that took, None if it never did."""
    t0, data = time.monotonic(), b""
    deadline = t0 + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            return data, time.monotonic() - t0
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk
    return data, None


def trickle(sock: socket.socket, data: bytes, every: float, stop: threading.Event) -> float:
    """Send ``data`` one byte per ``every`` seconds until it is sent, the peer closes, or ``stop``;
    returns the seconds the peer kept accepting bytes."""
    t0 = time.monotonic()
    for i in range(len(data)):
        try:
            sock.send(data[i:i + 1])
        except OSError:
            break
        if stop.wait(every):
            break
    return time.monotonic() - t0


def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """One whole response with a Content-Length body (the connection stays open)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += sock.recv(65536)
    return head + b"\r\n\r\n" + rest


def status_of(response: bytes) -> int | None:
    line = response.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[1].isdigit() else None


class HealthProbe:
    """GET /health in a loop on its own connection while a hostile case runs."""

    def __init__(self, url: str, headers: dict | None = None, interval: float = 0.02) -> None:
        self.url, self.headers, self.interval = url, headers or {}, interval
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=10) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    status = c.get("/health").status_code
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                else:
                    self.latencies.append(time.perf_counter() - t0)
                    if status != 200:
                        self.failures.append(f"status {status}")
                self._stop.wait(self.interval)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        self._wait_for_samples(1)  # probing before the hostile case starts
        return self

    def __exit__(self, *exc) -> None:
        self._wait_for_samples(5)
        self._stop.set()
        self._thread.join(15)

    def _wait_for_samples(self, n: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.latencies) + len(self.failures) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    @property
    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]

    def check(self, bound: float = 1.0, name: str = "") -> None:
        """/health stayed up throughout; p99 under ``bound`` (loose: two loaded cores)."""
        assert not self.failures, self.failures[:5]
        assert len(self.latencies) >= 5, f"only {len(self.latencies)} probes ran"
        print(f"\n[health p99] {name}: {self.p99 * 1000:.1f} ms over {len(self.latencies)} probes")
        assert self.p99 < bound, f"/health p99 {self.p99:.3f}s"


class ServerProcess:
    """``epd-encoder serve`` in a child process (optionally under a lower open-file limit);
    its stderr lines are collected as they come."""

    def __init__(self, model_dir, *extra: str, nofile: int | None = None) -> None:
        import resource
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd_encoder.cli", "serve", "--model", str(model_dir), "--port", str(port),
             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=limit)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become ready:\n" + "".join(self.lines[-30:]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.lines)
