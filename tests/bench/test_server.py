# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import sys

import pytest

from epd_encoder.bench.server import ServerProcess, ServerStartError, free_port, naive_command

# A stand-in server: /health answers 200; SIGTERM ends it with status 0 (as uvicorn's shutdown does).
FAKE = """
import signal, sys, http.server
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
print("fake up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_starts_waits_for_health_and_stops_with_sigterm(tmp_path):
    port = free_port()
    s = ServerProcess([sys.executable, "-c", FAKE, str(port)], port, tmp_path / "fake.log")
    with s:
        assert s.proc.poll() is None and s.url == f"http://127.0.0.1:{port}"
    assert s.proc.returncode == 0  # its SIGTERM handler ran: not killed
    assert "fake up" in s.log.read_text()


def test_a_server_that_exits_reports_its_log(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; print('no checkpoint here'); sys.exit(3)"]
    with pytest.raises(ServerStartError, match="exited with 3(.|\n)*no checkpoint here"):
        ServerProcess(cmd, port, tmp_path / "bad.log").start()


def test_naive_command_needs_the_script(tmp_path):
    with pytest.raises(ServerStartError, match="naive baseline needs"):
        naive_command("m", 1, tmp_path / "missing.py")
