# SPDX-License-Identifier: Apache-2.0
"""Servers the bench starts: a real subprocess on a free loopback port.

Up once ``GET /health`` answers 200; stopped with SIGTERM (then SIGKILL after a grace
period). Its output goes to a log file, whose tail is the error when it does not start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import epd_encoder

NAIVE_SERVER = Path(epd_encoder.__file__).resolve().parents[1] / "benchmarks" / "naive_server.py"


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, port: int, serve_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "epd_encoder.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), *serve_args]


def naive_command(model: str, port: int, script: Path = NAIVE_SERVER) -> list[str]:
    if not script.is_file():
        raise ServerStartError(f"the naive baseline needs {script} (a source checkout's benchmarks/)")
    return [sys.executable, str(script), model, str(port)]


class ServerProcess:
    """``with ServerProcess(cmd, port, log) as s:`` then ``s.url``."""

    def __init__(self, cmd: list[str], port: int, log: Path, *, start_timeout: float = 300.0,
                 stop_timeout: float = 30.0) -> None:
        self.cmd, self.log = cmd, log
        self.url = f"http://127.0.0.1:{port}"
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            exited = self.proc.poll()
            if exited is not None or time.monotonic() > deadline:
                self.stop()
                why = f"exited with {exited}" if exited is not None else f"not healthy in {self.start_timeout:g} s"
                raise ServerStartError(f"{' '.join(self.cmd[:5])} ... {why}; log {self.log}:\n{self.tail()}")
            time.sleep(0.2)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``stop_timeout``; the exit status."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)
        return p.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def environment() -> dict:
    import platform

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine()}
