# SPDX-License-Identifier: Apache-2.0
"""The proxy's side toward vLLM: pick one server per request, forward, stream the answer back
unchanged (docs/proxy.md). A spreader over a few servers, not a router: no health checks, no
affinity; a server that refuses the connection is skipped for that request only."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Mapping, Sequence

import httpx
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx sets itself for the new body.
_DROP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
         "upgrade", "host", "content-length"}


class Unreachable(Exception):
    """No vLLM server took the connection."""


class LLMPool:
    """The vLLM servers; each request goes to the one with the fewest requests outstanding
    through this proxy, ties broken in turn so an idle pool is visited round robin."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("no vLLM server given")
        self.urls = [u.rstrip("/") for u in urls]
        self.outstanding = dict.fromkeys(self.urls, 0)
        self._turn = itertools.count()

    def order(self) -> list[str]:
        """Servers to try for one request, best first (the rest are fall-backs on a refused connection)."""
        start = next(self._turn) % len(self.urls)
        rotated = self.urls[start:] + self.urls[:start]
        return sorted(rotated, key=self.outstanding.__getitem__)  # stable: rotation breaks ties


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP}


class Upstream:
    """Sends a request to vLLM and returns its response as a stream, bytes unchanged."""

    def __init__(self, pool: LLMPool, client: httpx.AsyncClient) -> None:
        self.pool = pool
        self.client = client

    async def send(self, method: str, path: str, query: str, headers: Mapping[str, str],
                   body: bytes) -> StreamingResponse:
        """``Unreachable`` when every server refuses the connection; once one has the request,
        whatever it answers (its errors included) goes back as it is."""
        target = path + (f"?{query}" if query else "")
        last: Exception | None = None
        for url in self.pool.order():
            request = self.client.build_request(method, url + target, headers=forward_headers(headers),
                                                content=body)
            self.pool.outstanding[url] += 1
            try:
                response = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached vLLM: try the next
                self.pool.outstanding[url] -= 1
                log.warning("vLLM at %s refused the connection: %s", url, e)
                last = e
                continue
            except BaseException:
                self.pool.outstanding[url] -= 1
                raise
            done = _Release(self.pool, url, response)
            return StreamingResponse(self._relay(response, done), status_code=response.status_code,
                                     headers=forward_headers(response.headers),
                                     background=BackgroundTask(done))
        raise Unreachable(f"no vLLM server took the connection ({type(last).__name__}: {last})")

    @staticmethod
    async def _relay(response: httpx.Response, done: _Release) -> AsyncIterator[bytes]:
        # aiter_raw: the bytes as vLLM sent them (SSE events, any content-encoding) unchanged.
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:  # a client that went away closes vLLM's stream too, so vLLM aborts the request
            await done()


class _Release:
    """Closes one forwarded response and gives its server's slot back, once."""

    def __init__(self, pool: LLMPool, url: str, response: httpx.Response) -> None:
        self.pool, self.url, self.response, self.done = pool, url, response, False

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.pool.outstanding[self.url] -= 1
        await self.response.aclose()
