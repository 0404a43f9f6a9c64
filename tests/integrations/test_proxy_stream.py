# SPDX-License-Identifier: Apache-2.0
"""A client that leaves a stream ends vLLM's stream too: real uvicorn servers on loopback (the
proxy's app as ``epd-encoder proxy`` builds it, and a fake vLLM that streams until its client goes)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from epd_encoder.config import ProxyConfig
from epd_encoder.integrations.proxy_app import build


class Running:
    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not (self.server.started and self.server.servers):
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def endless_vllm(sent: threading.Event, ended: threading.Event) -> Starlette:
    async def chat(request):
        async def events():
            try:
                while True:
                    yield b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
                    sent.set()
                    await asyncio.sleep(0.05)
            finally:  # the connection from the proxy closed: vLLM would abort the request here
                ended.set()
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_a_client_leaving_a_stream_ends_vllms_stream():
    sent, ended = threading.Event(), threading.Event()
    vllm = Running(endless_vllm(sent, ended))
    proxy = Running(build(ProxyConfig(encoder="http://127.0.0.1:9", llm=(vllm.url,))))
    try:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(timeout=30) as c, c.stream("POST", proxy.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            first = next(r.iter_raw())
            assert first.startswith(b"data: ")
        assert sent.is_set()
        assert ended.wait(20), "vLLM's stream stayed open after the client left"
        pool = proxy.server.config.app.state.proxy.upstream.pool
        deadline = time.monotonic() + 10
        while pool.outstanding[vllm.url] != 0:  # the slot comes back once the close is done
            assert time.monotonic() < deadline, pool.outstanding
            time.sleep(0.02)
    finally:
        proxy.stop()
        vllm.stop()
