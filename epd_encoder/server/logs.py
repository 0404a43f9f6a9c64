# SPDX-License-Identifier: Apache-2.0
"""Logging for ``serve``: one format, with timestamps, for our records and uvicorn's.

``configure_logging`` runs once at serve start (cli.py) and puts one handler on
the root logger. Every other library propagates to it rather than printing in a
format of its own: uvicorn gets ``log_config=None`` (server/http.py), so it
installs no handlers, and transformers' library handler is removed. ``text`` is
``<UTC ISO-8601 time> LEVEL logger: message``; ``json`` is one object per line
with ``ts``, ``level``, ``logger``, ``message`` (and ``exception``, and for an
access line ``client``, ``method``, ``path``, ``status``).

Probes are frequent and uninteresting: uvicorn's access lines for ``/health``
and ``/metrics`` are logged at DEBUG, so at the default level they are dropped.
With stderr not a terminal (a container, systemd, a pipe) no progress bar is
drawn: the weight loader logs one summary line instead (models/loading/loader.py), and
Hugging Face libraries' bars are turned off.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

from epd_encoder.config import LogConfig

QUIET_PATHS = frozenset({"/health", "/metrics"})
_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _access_fields(record: logging.LogRecord) -> dict | None:
    """uvicorn's access record: ``'%s - "%s %s HTTP/%s" %d'`` with (client, method, path, version, status)."""
    args = record.args
    if record.name != "uvicorn.access" or not isinstance(args, tuple) or len(args) != 5:
        return None
    client, method, path, _version, status = args
    return {"client": str(client), "method": str(method), "path": str(path), "status": status}


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _timestamp(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a message's newlines stay inside its string."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict = {"ts": _timestamp(record), "level": record.levelname, "logger": record.name,
                     "message": record.getMessage()}
        access = _access_fields(record)
        if access is not None:
            out.update(access)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class QuietProbes(logging.Filter):
    """Demote access lines of ``QUIET_PATHS`` to DEBUG: shown only when DEBUG is on."""

    def __init__(self, show: bool) -> None:
        super().__init__()
        self.show = show

    def filter(self, record: logging.LogRecord) -> bool:
        access = _access_fields(record)
        if access is None or access["path"].partition("?")[0] not in QUIET_PATHS:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return self.show


def configure_logging(cfg: LogConfig, stream: TextIO | None = None) -> logging.Handler:
    """Route every record through one handler on the root logger; idempotent. Returns it."""
    stream = sys.stderr if stream is None else stream
    level = getattr(logging, cfg.log_level.upper())
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if cfg.log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in _UVICORN:
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    access = logging.getLogger("uvicorn.access")
    for f in [f for f in access.filters if isinstance(f, QuietProbes)]:
        access.removeFilter(f)
    access.addFilter(QuietProbes(show=level <= logging.DEBUG))
    logging.captureWarnings(True)  # warnings.warn lines in the same format
    _route_library_logs(progress_bars=_isatty(stream))
    return handler


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _route_library_logs(progress_bars: bool) -> None:
    """transformers prints through its own handler and both HF libraries draw tqdm bars:
    send the former to ours, and turn the bars off when nobody watches a terminal."""
    try:
        import transformers.utils.logging as tf_logging
    except ImportError:
        tf_logging = None  # type: ignore[assignment]  # transformers is optional here
    if tf_logging is not None:
        tf_logging.disable_default_handler()
        tf_logging.enable_propagation()
        if not progress_bars:
            tf_logging.disable_progress_bar()
    if not progress_bars:
        try:
            from huggingface_hub.utils import disable_progress_bars
        except ImportError:
            return
        disable_progress_bars()
