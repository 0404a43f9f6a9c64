# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder route``'s flags: what it refuses before anything starts, in one line."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from epd_encoder.cli import main
from epd_encoder.config.router import RouterConfig
from tests.router.route_harness import Router, envoy_or_skip


@pytest.mark.parametrize("argv, message", [
    ([], "--backend URL (repeat for several) or --backends-file PATH is required"),
    (["--backend", "http://a:1", "--backends-file", "x.json"], "give --backend or --backends-file, not both"),
    (["--backend", "ftp://a:1"], "expected an http(s)://host[:port] URL"),
    (["--backend", "https://a:1"], "the router speaks plain HTTP to the servers"),
    (["--backend", "http://a:1/v1"], "a server is a host and port, without a path"),
    (["--backend", "http://a:1", "--hash-balance-factor", "99"], "--hash-balance-factor must be in 100..1000"),
    (["--backend", "http://a:1", "--envoy-path", "/nonexistent/envoy"], "--envoy-path /nonexistent/envoy: no executable"),
])
def test_route_refuses_what_it_cannot_run_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["route", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_backend_repeats_and_is_comma_separated_in_the_environment(monkeypatch):
    from epd_encoder.flags import resolve

    monkeypatch.setenv("EPD_ENCODER_BACKEND", "http://a:1,http://b:2")
    import argparse

    from epd_encoder.flags import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, RouterConfig)
    config, _ = resolve(RouterConfig, parser.parse_args([]))
    assert config.backend == ("http://a:1", "http://b:2")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_route_exits_0_after_draining_on_a_signal_and_takes_envoy_down(sig, tmp_path):
    """As ``serve`` (docs/operations.md, "Exit status after a signal"): not -15 or a traceback."""
    envoy_or_skip()
    router = Router("--backend", "http://127.0.0.1:9", log=tmp_path / "route.log")
    try:
        deadline = time.monotonic() + 60
        while router.healthy_servers() == -1:  # -1: no answer yet
            assert router.proc.poll() is None, router.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the router never answered"
            time.sleep(0.1)
        envoy = psutil.Process(router.proc.pid).children()
        assert envoy, "no Envoy under the router"
        router.proc.send_signal(sig)
        assert router.proc.wait(30) == 0, router.log.read_text()[-2000:]
        assert "Traceback" not in router.log.read_text()
        _, alive = psutil.wait_procs(envoy, timeout=10)
        assert not alive
    finally:
        router.stop()
