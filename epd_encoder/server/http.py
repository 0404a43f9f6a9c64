# SPDX-License-Identifier: Apache-2.0
"""The hardened HTTP server: one uvicorn Config for the CLI and the tests alike.

uvicorn bounds keep-alive idle time but not how long a client takes to send its
request head, and it accepts connections until the process runs out of file
descriptors. ``GuardedH11Protocol`` adds a head deadline and a connection cap
to uvicorn's h11 protocol; body deadlines live in the ASGI app (api/middleware.py
``BodyLimit``), which also answers 503 to half-sent bodies once a drain begins.
``GracefulServer`` makes its shutdown answer every connection the kernel accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from epd_encoder.api.errors import error_body
from epd_encoder.config import HttpConfig, ServeConfig

log = logging.getLogger(__name__)

_BUSY = json.dumps(error_body("overloaded", "too many open connections; retry later")).encode()
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY))
_HEAD_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
# At shutdown, how long a connection with no request yet has to send its head before it is closed.
SHUTDOWN_HEAD_GRACE_S = 2.0


class Closing:
    """Set when the server's graceful shutdown begins; one per server, shared by its connections."""

    def __init__(self) -> None:
        self.begun = False


def _nofile() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 65536 if soft == resource.RLIM_INFINITY else soft


def connection_cap(http: HttpConfig) -> int:
    """``--max-connections``, or half the soft open-file limit when it is 0."""
    return http.max_connections or max(8, _nofile() // 2)


def accept_backlog() -> int:
    """The listen backlog, which is also how many connections asyncio accepts in one go
    before any is counted: an eighth of the open-file limit, so cap (half) + burst leave
    3/8 of it to the process's own files, pipes and sockets."""
    return max(16, min(2048, _nofile() // 8))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with one deadline per connection state, a connection cap, and
    a drain hook. The states (docs/operations.md, "Connection states and timers"):

    head     a new connection, or part of a request head in: ``header_timeout``, then 408
    idle     between requests, nothing of the next one in: uvicorn's keep-alive timer
    request  a request in the app: its body under BodyLimit's deadline, then the engine's
    send     the client takes none of our bytes (writing paused): ``send_timeout``, then abort

    ``_retime`` moves the connection to its state's timer after every event that can change
    it. A response that completes before its request's body is all in closes the connection.
    Subclasses made by ``uvicorn_config`` set the class attributes below.
    """

    header_timeout: float = 60.0
    send_timeout: float = 60.0
    cap: int = 1024
    on_drain = None  # called when the server begins its graceful shutdown
    closing: Closing | None = None  # one per server, set by uvicorn_config

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0
        super().connection_made(transport)
        if len(self.connections) > self.cap and not self._reclaim_idle():
            log.warning("connection cap %d reached: refusing new connections with 503", self.cap)
            transport.write(_REFUSED)
            transport.close()
            return
        self._retime()
        if self.closing is not None and self.closing.begun:  # taken from the listen queue at shutdown
            self._await_last_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._retime()

    def handle_events(self) -> None:
        super().handle_events()
        if self.closing is not None and self.closing.begun and self.cycle is not None:
            self.cycle.keep_alive = False  # a request that came during the drain is the connection's last

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # Answered before its body was all in: the rest goes with the connection, never read.
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()
        super().on_response_complete()
        self._retime()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._retime()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._retime()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_send_timer()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """uvicorn closes a connection with no request in flight at once: one whose request
        head is on its way (or unread in the socket, where close() sends a reset) would get no
        answer. Such a connection is served its one request instead, if the head comes soon."""
        if self.closing is not None:
            self.closing.begun = True  # already, under GracefulServer
        if self.on_drain is not None:
            self.on_drain()
        if self.state() == "head" and not self.transport.is_closing():
            return self._await_last_head()
        super().shutdown()

    def _await_last_head(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(min(self.header_timeout, SHUTDOWN_HEAD_GRACE_S),
                                                self._head_timed_out)

    def state(self) -> str:
        """head | idle | request | send | closed (see the class docstring)."""
        if self.flow.write_paused:  # even once closed: close() waits for the buffer to drain
            return "send"
        if self.transport.is_closing():
            return "closed"
        if self.conn.their_state is not h11.IDLE or (self.cycle is not None and not self.cycle.response_complete):
            return "request"
        return "head" if self.cycle is None or self.conn.trailing_data[0] else "idle"

    def _retime(self) -> None:
        """Cancel every timer but the current state's, and arm that one if it is not armed.
        A deadline counts from entering its state (head: from accept or the first byte)."""
        state = self.state()
        if state != "head":
            self._cancel_head_timer()
        if state != "send":
            self._cancel_send_timer()
        if state != "idle":
            self._unset_keepalive_if_required()
        if state == "head" and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)
        elif state == "idle" and self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
        elif state == "send" and self._send_timer is None:
            self._unsent = self.transport.get_write_buffer_size()
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.state() != "head":
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why (nginx only logs it)
            log.warning("closed %s: no complete request head within %.0f s", self.client, self.header_timeout)
            self.transport.write(_HEAD_TIMEOUT)
        self.transport.close()

    def _send_timed_out(self) -> None:
        """Abort once the client has taken none of our bytes for ``send_timeout`` (nginx's
        send_timeout): close() alone would wait on the unsent buffer for ever."""
        self._send_timer = None
        left = self.transport.get_write_buffer_size()
        if self.state() != "send" or not left:
            return self._retime()
        if left < self._unsent:  # slow, but taking bytes: a new period
            return self._retime()
        log.warning("aborted %s: it took none of %d response bytes in %.0f s", self.client, left,
                    self.send_timeout)
        self.transport.abort()

    def _is_idle(self) -> bool:
        return self.state() == "idle"

    def _reclaim_idle(self) -> bool:
        """Close one idle keep-alive connection to make room, as nginx does at its cap."""
        for other in list(self.connections):
            if other is not self and isinstance(other, GuardedH11Protocol) and other._is_idle():
                other.timeout_keep_alive_handler()
                self.connections.discard(other)
                return True
        return False


class RateLimitFilter(logging.Filter):
    """Pass at most ``burst`` records with the same logger, level and message template per
    ``period`` seconds; the first record after a quiet spell says how many were dropped.

    Bounds log floods (accept() failing on every loop turn, a flood of refused clients)
    without hiding a new kind of message. uvicorn's access lines pass: they all share one
    template, so limiting them would keep 5 requests in 10 s of the access log.
    """

    def __init__(self, burst: int = 5, period: float = 10.0, max_keys: int = 1024) -> None:
        super().__init__()
        self.burst, self.period, self.max_keys = burst, period, max_keys
        self._windows: dict[tuple, list] = {}  # key -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.access":
            return True
        now = time.monotonic()
        key = (record.name, record.levelno, str(record.msg))
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.period:
            dropped = window[2] if window else 0
            if len(self._windows) >= self.max_keys:
                self._windows.clear()  # bounded memory; at worst a few extra records pass
            self._windows[key] = window = [now, 0, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} similar records suppressed]"
        if window[1] >= self.burst:
            window[2] += 1
            return False
        window[1] += 1
        return True


def install_log_rate_limit() -> None:
    """Put one RateLimitFilter on every handler of the root and uvicorn loggers."""
    for name in (None, "uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RateLimitFilter) for f in handler.filters):
                handler.addFilter(RateLimitFilter())


def uvicorn_config(app, config: ServeConfig, *, host: str | None = None, port: int | None = None,
                   log_level: str | None = None) -> uvicorn.Config:
    """The one uvicorn Config for ``app``: timeouts, connection cap, drain hook, log limits.

    ``app.state.drain`` (set by create_app), if present, is begun when shutdown starts.
    uvicorn installs no log handlers of its own (``log_config=None``): its records go to
    the root logger, formatted as ours (server/logs.py); ``log_level`` defaults to
    ``--log-level``.
    """
    http = config.http
    drain = getattr(getattr(app, "state", None), "drain", None)
    protocol = type("GuardedH11", (GuardedH11Protocol,), {
        "header_timeout": http.header_timeout, "send_timeout": http.send_timeout, "cap": connection_cap(http),
        "on_drain": staticmethod(drain.begin) if drain is not None else None, "closing": Closing(),
    })
    cfg = uvicorn.Config(
        app, host=config.host if host is None else host, port=config.port if port is None else port,
        log_config=None, log_level=config.log.log_level if log_level is None else log_level,
        http=protocol, ws="none", timeout_keep_alive=http.keep_alive_timeout,
        backlog=accept_backlog(),
        timeout_graceful_shutdown=int(config.drain_timeout))
    install_log_rate_limit()  # on the handlers in place (server/logs.py's root handler under serve)
    return cfg


_SO_ATTACH_FILTER = 26  # Linux <asm-generic/socket.h>; the socket module does not name it


def _drop_new_handshakes(listener: socket.socket) -> None:
    """Attach a one-instruction BPF program (``ret #0``: drop) to ``listener``: no handshake
    completes from here, so the queue taken next is the last. A client's dropped SYN is
    retried and refused once the listener is closed: it is never taken and then reset."""
    program = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))  # BPF_RET | BPF_K, k=0
    fprog = struct.pack("HP", 1, ctypes.addressof(program))
    listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)


def _take_listen_queue(server: asyncio.base_events.Server) -> list[socket.socket]:
    """The connections the kernel completed but asyncio has not accepted yet, which closing
    the listener would reset. New handshakes are stopped first where the platform allows."""
    taken = []
    for listening in server.sockets:
        listener = socket.socket(fileno=os.dup(listening.fileno()))  # closed below; the listener stays
        try:
            if sys.platform == "linux":
                with contextlib.suppress(OSError):
                    _drop_new_handshakes(listener)
            listener.setblocking(False)
            while True:
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:  # EMFILE and the like: what is left is reset with the listener
                    log.warning("at shutdown, could not take a queued connection: %s", e)
                    break
                conn.setblocking(False)
                taken.append(conn)
        finally:
            listener.close()
    return taken


class GracefulServer(uvicorn.Server):
    """uvicorn's server, but every connection the kernel accepted gets an answer: at shutdown
    the listen queue is taken (new handshakes stopped first) before the listener closes, and
    each taken connection is served its one request like any other open connection
    (``GuardedH11Protocol.shutdown``)."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        closing = getattr(self.config.http_protocol_class, "closing", None)
        if isinstance(closing, Closing):
            closing.begun = True
            loop = asyncio.get_running_loop()
            for server in self.servers:
                factory = server._protocol_factory  # uvicorn's, bound to this server's state
                for conn in _take_listen_queue(server):
                    await loop.connect_accepted_socket(factory, conn)
        await super().shutdown(sockets)


@contextlib.contextmanager
def drain_exits_zero() -> Iterator[None]:
    """uvicorn re-raises the SIGTERM / SIGINT it drained on to the handlers it found: no-op ones
    make a completed drain exit 0, not -15 (143 in a shell) or a KeyboardInterrupt traceback
    (docs/operations.md, "Exit status after a signal"). uvicorn's own handlers cover the serve."""
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(app, config: ServeConfig) -> int:
    """Serve ``app`` until shutdown; the exit status of ``epd-encoder serve``.

    1 when the model fails to load (AppState.load has logged why), or when serving fails
    for good (a tensor-parallel rank died or hung: AppState.serving_failed): the server
    stops at once rather than staying up to answer 503, so a supervisor restarts or
    reports it. Answers already owed go out first (uvicorn's graceful shutdown). 0 after a
    drain on SIGTERM or SIGINT (Ctrl-C). uvicorn itself exits 3 (its STARTUP_FAILURE) when
    the port cannot be bound.
    """
    server = GracefulServer(uvicorn_config(app, config))
    state = app.state.epd

    def stop(_error: BaseException) -> None:
        server.should_exit = True  # read by uvicorn's main loop (or after its start-up)

    state.on_failure = stop
    with drain_exits_zero():
        server.run()
    if state.failed is not None:
        return 1
    return 0 if server.started else 3  # uvicorn's STARTUP_FAILURE
