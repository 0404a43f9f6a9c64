# SPDX-License-Identifier: Apache-2.0
"""A real ``mooncake_master`` on loopback, started by the test (skips without the Mooncake wheel).

Tests take the ``mooncake_master`` fixture by importing it from here."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    def __init__(self, log: Path, *extra: str, port: int | None = None) -> None:
        exe = shutil.which("mooncake_master") or str(Path(sys.executable).with_name("mooncake_master"))
        if not Path(exe).exists():
            pytest.skip("mooncake_master is not installed")
        self.port, self.http, self.log = port or free_port(), free_port(), log
        self.proc = subprocess.Popen([exe, f"-rpc_port={self.port}", "-enable_http_metadata_server=true",
                                      f"-http_metadata_server_port={self.http}", f"-metrics_port={free_port()}",
                                      *extra], stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:  # ready once it accepts on its RPC port
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.proc.kill()
                    pytest.fail("mooncake_master did not start: " + log.read_text()[-2000:])
                time.sleep(0.1)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def mooncake_master(tmp_path):
    """(master host:port, metadata URL) of a fresh master."""
    pytest.importorskip("mooncake.store")
    m = Master(tmp_path / "master.log")
    yield m.address, m.metadata
    m.stop()


@pytest.fixture
def master_process(tmp_path):
    """The ``Master`` itself (to kill it mid-test), with a 1 s read lease."""
    pytest.importorskip("mooncake.store")
    m = Master(tmp_path / "master.log", "-default_kv_lease_ttl=1000")
    yield m
    m.stop()
