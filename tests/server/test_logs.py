# SPDX-License-Identifier: Apache-2.0
"""Logs: one timestamped format (text or JSON lines) for ours and uvicorn's, probes quiet at
INFO, and no progress bar when stderr is not a terminal. The end-to-end checks run a real
``epd-encoder serve`` with its stderr on a pipe, as under a container runtime or systemd."""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from epd_encoder.config import LogConfig
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.server.logs import JsonFormatter, QuietProbes, TextFormatter, configure_logging

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def record(name: str, msg: str, args=(), level=logging.INFO, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)


def access(path: str, status: int = 200) -> logging.LogRecord:
    return record("uvicorn.access", '%s - "%s %s HTTP/%s" %d', ("127.0.0.1:5000", "GET", path, "1.1", status))


def test_json_lines_carry_a_timestamp_level_logger_message_and_exception():
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        rec = record("epd_encoder.x", "failed %s", ("twice",), logging.ERROR, sys.exc_info())
    line = JsonFormatter().format(rec)
    assert "\n" not in line  # one record, one line, whatever the message holds
    out = json.loads(line)
    assert ISO.match(out["ts"]) and out["level"] == "ERROR" and out["logger"] == "epd_encoder.x"
    assert out["message"] == "failed twice"
    assert "ValueError: bad\nthing" in out["exception"]
    fields = json.loads(JsonFormatter().format(access("/v1/encode?x=1", 413)))
    assert fields["method"] == "GET" and fields["path"] == "/v1/encode?x=1" and fields["status"] == 413


def test_text_lines_start_with_a_utc_timestamp():
    assert TEXT_LINE.match(TextFormatter().format(record("uvicorn.error", "Started")))


@pytest.mark.parametrize("path", ["/health", "/metrics", "/health?probe=lb"])
def test_probe_access_lines_are_debug_only(path):
    rec = access(path)
    assert QuietProbes(show=False).filter(rec) is False
    rec = access(path)
    assert QuietProbes(show=True).filter(rec) is True and rec.levelname == "DEBUG"
    other = access("/v1/models")
    assert QuietProbes(show=False).filter(other) is True and other.levelname == "INFO"


def test_configure_logging_routes_uvicorn_through_one_root_handler():
    buf = io.StringIO()
    root, saved = logging.getLogger(), (logging.getLogger().handlers[:], logging.getLogger().level)
    try:
        configure_logging(LogConfig(log_format="json", log_level="warning"), stream=buf)
        logging.getLogger("uvicorn.error").warning("from uvicorn")
        logging.getLogger("epd_encoder.test").warning("from us")
        logging.getLogger("epd_encoder.test").info("below the level")
        configure_logging(LogConfig(log_format="json", log_level="warning"), stream=buf)  # idempotent
        logging.getLogger("epd_encoder.test").warning("once")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for f in list(logging.getLogger("uvicorn.access").filters):
            logging.getLogger("uvicorn.access").removeFilter(f)
        logging.captureWarnings(False)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [(x["logger"], x["message"]) for x in lines] == [
        ("uvicorn.error", "from uvicorn"), ("epd_encoder.test", "from us"), ("epd_encoder.test", "once")]


# -- a real server, its stderr on a pipe ----------------------------------------------------
class Serve:
    """``epd-encoder serve`` in a subprocess; its stderr lines are collected by a thread."""

    def __init__(self, model, *flags: str, env: dict | None = None) -> None:
        model_flags = [] if model is None else ["--model", str(model)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd_encoder.cli", "serve", *model_flags, "--port", "0", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=None if env is None else {**os.environ, **env})
        self.lines: list[str] = []
        self._new: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self._new.put(line)

    def wait_line(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        for line in self.lines:
            if m := re.search(pattern, line):
                return m
        while time.monotonic() < deadline:
            try:
                line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(self.lines)}")

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """``sig``, wait for the exit, and return everything it wrote to stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        self.wait_line("Finished server process|Application shutdown complete", timeout=10)
        while not self._new.empty():
            self.lines.append(self._new.get())
        return "".join(self.lines)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # Two shards, the vision tensors in one: the summary says it opened 1 of 2.
    return write_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "m", num_shards=2)


def probe(serve: Serve, *paths: str) -> None:
    url = serve.wait_line(r"Uvicorn running on (http://127\.0\.0\.1:\d+)").group(1)
    serve.wait_line(r"ready: ")
    with httpx.Client(base_url=url, timeout=30) as c:
        for path in paths:
            c.get(path)
    # The access line of the last request is the sequencing point: every earlier one is out.
    serve.wait_line(re.escape(paths[-1]))


def no_bars(text: str) -> None:
    assert "\r" not in text and "it/s" not in text and "tensor/s" not in text and "%|" not in text, text


def test_serve_json_logs_one_object_per_line_with_probes_quiet(tiny):
    s = Serve(tiny, "--log-format", "json")
    try:
        # Eight alike: more than the rate limit's burst of 5, which access lines are exempt from.
        probe(s, "/health", "/metrics", "/health", *["/v1/models"] * 8)
    finally:
        text = s.stop()
    assert s.proc.returncode == 0
    lines = [json.loads(line) for line in text.splitlines()]  # every line parses: no stray prints
    for x in lines:
        assert ISO.match(x["ts"]) and x["level"] in ("INFO", "WARNING") and x["logger"] and "message" in x
    loggers = {x["logger"] for x in lines}
    assert {"uvicorn.error", "uvicorn.access", "epd_encoder.server.runtime", "epd_encoder.models.loading.loader"} <= loggers
    paths = [x["path"] for x in lines if x["logger"] == "uvicorn.access"]
    assert paths == ["/v1/models"] * 8  # the probes are not access-logged at INFO
    (summary,) = [x["message"] for x in lines if x["logger"] == "epd_encoder.models.loading.loader"]
    assert re.fullmatch(r"loaded \d+ vision tensors \([\d.]+ MiB\) from 1 of 2 shards in [\d.]+ s", summary)
    no_bars(text)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_drained_shutdown_exits_0_without_a_traceback(tiny, sig):
    # uvicorn re-raises the signal it drained on: the process would die by it (-15, 143 in a
    # shell; -2 and a KeyboardInterrupt traceback for Ctrl-C). docs/operations.md, "Exit status".
    s = Serve(tiny)
    try:
        s.wait_line(r"ready: ")
    finally:
        text = s.stop(sig)
    assert s.proc.returncode == 0, text[-2000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-2000:]


def test_serve_text_logs_at_debug_show_the_probes_in_the_same_format(tmp_path):
    # No --model and an empty cache: the tiny model is written first, through transformers,
    # whose save draws a tqdm bar ("Writing model shards") unless bars are off.
    s = Serve(None, "--log-level", "debug", env={"EPD_ENCODER_CACHE": str(tmp_path)})
    try:
        probe(s, "/health", "/v1/models")
    finally:
        text = s.stop()
    lines = text.splitlines()
    assert lines and all(TEXT_LINE.match(line) for line in lines), text
    assert any("serving the built-in tiny model" in line for line in lines)
    assert any(re.search(r" DEBUG uvicorn\.access: .*\"GET /health HTTP/1\.1\" 200", line) for line in lines)
    assert any(re.search(r" INFO uvicorn\.access: .*\"GET /v1/models HTTP/1\.1\" 200", line) for line in lines)
    no_bars(text)
