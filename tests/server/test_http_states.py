# SPDX-License-Identifier: Apache-2.0
"""GuardedH11Protocol's connection states, driven event by event over a fake transport:
after every transition exactly the current state's timer is armed (docs/operations.md,
"Connection states and timers"). Timers are fired by hand, so nothing here waits on a clock."""

from __future__ import annotations

import asyncio

from uvicorn.server import ServerState

from epd_encoder.config import HttpConfig, ServeConfig
from epd_encoder.server.http import uvicorn_config

GET = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written, self.closing, self.aborted, self.unsent = bytearray(), False, False, 0
        self.protocol = None

    def write(self, data) -> None:
        self.written += data

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            if not self.unsent:  # as asyncio: the protocol is told once the buffer is flushed
                self.protocol.connection_lost(None)

    def abort(self) -> None:
        self.aborted, self.unsent = True, 0
        if not self.closing:
            self.closing = True
        self.protocol.connection_lost(None)

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return self.unsent


class App:
    """Answers 200 to each request once ``release`` is set (set from the start unless held)."""

    def __init__(self, held: bool = False) -> None:
        self.release = asyncio.Event()
        if not held:
            self.release.set()

    async def __call__(self, scope, receive, send) -> None:
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def _connect(app: App):
    config = ServeConfig(http=HttpConfig(header_timeout=5, body_timeout=5, keep_alive_timeout=5, send_timeout=5))
    cfg = uvicorn_config(app, config, port=0, log_level="warning")
    cfg.load()
    proto = cfg.http_protocol_class(config=cfg, server_state=ServerState(), app_state={})
    transport = FakeTransport()
    transport.protocol = proto
    proto.connection_made(transport)
    return proto, transport


def armed(proto) -> set[str]:
    timers = {"head": proto._head_timer, "idle": proto.timeout_keep_alive_task, "send": proto._send_timer}
    return {name for name, handle in timers.items() if handle is not None and not handle.cancelled()}


def expect(proto, state: str) -> None:
    """The protocol is in ``state`` under that state's timer alone (none while in the app or closed)."""
    assert proto.state() == state
    assert armed(proto) == ({state} if state in ("head", "idle", "send") else set()), armed(proto)


async def _settle() -> None:
    for _ in range(5):  # let the request task run to its answer
        await asyncio.sleep(0)


def run(coro) -> None:
    asyncio.run(coro)


def test_head_request_idle_head_and_back():
    async def go():
        proto, t = _connect(App())
        expect(proto, "head")  # a new connection: counted from accept
        first = proto._head_timer
        proto.data_received(b"GET /x HTTP/1.1\r\n")
        expect(proto, "head")
        assert proto._head_timer is first  # more bytes do not restart the head deadline
        proto.data_received(b"Host: x\r\n\r\n")
        expect(proto, "request")
        await _settle()
        assert b"200 OK" in t.written
        expect(proto, "idle")
        proto.data_received(b"GET /x HTT")  # the first byte of the next head ends idle
        expect(proto, "head")
        proto.data_received(b"P/1.1\r\nHost: x\r\n\r\n")
        await _settle()
        expect(proto, "idle")
        proto.timeout_keep_alive_handler()
        expect(proto, "closed")
    run(go())


def test_a_head_past_its_deadline_gets_408_and_is_closed():
    async def go():
        proto, t = _connect(App())
        proto.data_received(b"GET /x HTTP/1.1\r\n")
        proto._head_timed_out()
        assert t.written.startswith(b"HTTP/1.1 408") and t.closing
        expect(proto, "closed")
    run(go())


def test_a_request_in_the_app_is_under_no_connection_timer_until_it_answers():
    async def go():
        app = App(held=True)
        proto, _ = _connect(app)
        proto.data_received(GET)
        await _settle()
        expect(proto, "request")
        app.release.set()
        await _settle()
        expect(proto, "idle")
    run(go())


def test_an_answer_before_the_body_is_all_in_closes_the_connection():
    """The defect: answered with the body unread, the next body byte cancelled the keep-alive
    timer and nothing replaced it, so the connection had no deadline at all."""
    async def go():
        proto, t = _connect(App())
        proto.data_received(b"GET /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab")
        await _settle()
        assert b"200 OK" in t.written and t.closing
        expect(proto, "closed")
    run(go())


def test_a_pipelined_partial_head_is_under_the_head_deadline_once_the_answer_is_out():
    async def go():
        app = App(held=True)
        proto, t = _connect(app)
        proto.data_received(GET + b"GET /x HTTP/1.1\r\nX-")
        expect(proto, "request")  # the second head waits behind the first answer
        app.release.set()
        await _settle()
        expect(proto, "head")
        proto._head_timed_out()
        assert t.written.endswith(b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
    run(go())


def test_pipelined_whole_requests_are_answered_in_turn_then_idle():
    async def go():
        proto, t = _connect(App())
        proto.data_received(GET * 3)
        for _ in range(3):
            await _settle()
        assert t.written.count(b"200 OK") == 3
        expect(proto, "idle")
    run(go())


def test_a_client_taking_no_bytes_is_aborted_at_the_send_deadline():
    async def go():
        proto, t = _connect(App())
        proto.data_received(GET)
        await _settle()
        t.unsent = 1 << 20
        proto.pause_writing()  # the transport's buffer is over its high-water mark
        expect(proto, "send")
        proto.timeout_keep_alive_handler()  # a close now would wait on the buffer for ever...
        expect(proto, "send")  # ...so the send deadline still holds the connection
        t.unsent -= 1000  # progress: a new period, no abort
        proto._send_timed_out()
        expect(proto, "send")
        assert not t.aborted
        proto._send_timed_out()  # nothing taken for a whole period
        assert t.aborted
        expect(proto, "closed")
    run(go())


def test_a_drained_buffer_returns_to_idle_under_a_fresh_keep_alive():
    async def go():
        proto, t = _connect(App())
        proto.data_received(GET)
        await _settle()
        t.unsent = 1 << 20
        proto.pause_writing()
        expect(proto, "send")
        t.unsent = 0
        proto.resume_writing()
        expect(proto, "idle")
    run(go())
