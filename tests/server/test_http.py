# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import logging

from epd_encoder.config import HttpConfig, ServeConfig
from epd_encoder.server import http
from epd_encoder.server.http import RateLimitFilter, uvicorn_config


def _record(msg: str = "accept failed", level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("asyncio", level, __file__, 1, msg, None, None)


def test_a_flood_of_one_message_passes_only_its_burst(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(http.time, "monotonic", lambda: now[0])
    f = RateLimitFilter(burst=3, period=10.0)
    assert sum(f.filter(_record()) for _ in range(10_000)) == 3
    assert f.filter(_record("another message"))  # a new kind of message is never hidden
    now[0] = 10.0
    first = _record()
    assert f.filter(first) and "9997 similar records suppressed" in first.getMessage()


def test_the_cap_defaults_to_half_the_fd_limit(monkeypatch):
    monkeypatch.setattr(http, "_nofile", lambda: 1024)
    assert http.connection_cap(HttpConfig()) == 512
    assert http.connection_cap(HttpConfig(max_connections=100)) == 100
    assert http.accept_backlog() == 128


def test_one_config_carries_every_knob():
    config = ServeConfig(http=HttpConfig(header_timeout=3, keep_alive_timeout=7, max_connections=9))
    cfg = uvicorn_config(object(), config, port=0, log_level="warning")
    assert cfg.timeout_keep_alive == 7 and cfg.timeout_graceful_shutdown == int(config.drain_timeout)
    assert cfg.http.header_timeout == 3 and cfg.http.cap == 9 and cfg.ws == "none"
