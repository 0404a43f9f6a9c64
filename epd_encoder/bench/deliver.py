# SPDX-License-Identifier: Apache-2.0
"""One timed request per delivery mode: the metadata and the embeddings, from the send.

- inline: metadata when the 200's headers arrive, embeddings once its body is read;
- pull: metadata on the 200 JSON, embeddings once every item's ``GET`` is read;
- push: metadata on the 202, embeddings once the room is done on our receiver.

A request that fails at any step counts as an error with its HTTP status (or
``transport`` / ``timeout`` / the receiver's error code), never as a latency.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import httpx


@dataclass(frozen=True)
class Outcome:
    start: float  # perf_counter at the send
    status: str  # "200", "202", "429", ..., "transport", "timeout", a push error code
    metadata_s: float | None = None
    embeddings_s: float | None = None
    cache: tuple[str, ...] = ()  # per item, as the server said ("hit" / "miss" / "coalesced"), if it said
    error: str | None = None  # the error body's code or the exception, for the log

    @property
    def ok(self) -> bool:
        return self.embeddings_s is not None


class Deliverer(Protocol):
    """Sends one encode request and times it. Never raises for a failed request."""

    mode: str

    async def __call__(self, client: httpx.AsyncClient, request_id: str, items: list[dict],
                       extra: dict[str, Any]) -> Outcome: ...


def _error(start: float, r: httpx.Response) -> Outcome:
    """A non-success answer, its body already read."""
    try:
        code = r.json()["error"]["code"]
    except Exception:  # a body that is not ours (a baseline's, a proxy's)
        code = r.text[:120] or None
    return Outcome(start, str(r.status_code), error=code)


def inline_cache_states(body: bytes) -> tuple[str, ...]:
    """The items' cache states from a safetensors body's ``__metadata__``; () if it has none."""
    try:
        (n,) = struct.unpack("<Q", body[:8])
        meta = json.loads(body[8:8 + n]).get("__metadata__") or {}
        return tuple(str(i.get("cache")) for i in json.loads(meta["items"]))
    except Exception:  # a baseline's raw body: no states to count
        return ()


async def _guard(start: float, coro) -> Outcome:
    try:
        return await coro
    except httpx.TimeoutException as e:
        return Outcome(start, "timeout", error=type(e).__name__)
    except httpx.HTTPError as e:
        return Outcome(start, "transport", error=f"{type(e).__name__}: {e}"[:200])


class Inline:
    mode = "inline"

    async def __call__(self, client, request_id, items, extra):
        start = time.perf_counter()

        async def go() -> Outcome:
            body = {"request_id": request_id, "items": items, **extra}
            async with client.stream("POST", "/v1/encode", json=body) as r:
                meta = time.perf_counter() - start
                data = await r.aread()
                if r.status_code != 200:
                    return _error(start, r)
                return Outcome(start, "200", meta, time.perf_counter() - start, inline_cache_states(data))

        return await _guard(start, go())


class Pull:
    mode = "pull"

    async def __call__(self, client, request_id, items, extra):
        start = time.perf_counter()

        async def go() -> Outcome:
            body = {"request_id": request_id, "items": items, "delivery": {"mode": "pull"}, **extra}
            r = await client.post("/v1/encode", json=body)
            if r.status_code != 200:
                return _error(start, r)
            meta = time.perf_counter() - start
            infos = r.json()["items"]
            for got in await asyncio.gather(*(client.get(i["url"]) for i in infos)):
                await got.aread()
                if got.status_code != 200:
                    return _error(start, got)
            return Outcome(start, "200", meta, time.perf_counter() - start, tuple(i["cache"] for i in infos))

        return await _guard(start, go())


class Push:
    """Through one ``EmbeddingReceiver`` (its own threads); a room's wait runs on a thread
    of a pool sized for every request in flight, and stamps the time itself."""

    mode = "push"

    def __init__(self, receiver: Any, timeout: float, max_in_flight: int = 512) -> None:
        self.rx, self.timeout = receiver, timeout
        self._waits = ThreadPoolExecutor(max_in_flight, thread_name_prefix="bench-push")

    def close(self) -> None:
        self._waits.shutdown(wait=False, cancel_futures=True)

    def _wait(self, room: str) -> tuple[float | None, str | None]:
        try:
            self.rx.wait(room, timeout=self.timeout)
            return time.perf_counter(), None
        except Exception as e:  # the room failed: its typed code is the error
            return None, getattr(e, "code", type(e).__name__)

    async def __call__(self, client, request_id, items, extra):
        room = f"bench-{request_id}"
        delivery = self.rx.delivery(room)
        start = time.perf_counter()

        async def go() -> Outcome:
            r = await client.post("/v1/encode", json={"request_id": request_id, "items": items,
                                                      "delivery": delivery, **extra})
            if r.status_code != 202:
                self.rx.discard(room)
                return _error(start, r)
            meta = time.perf_counter() - start
            cache = tuple("hit" if i["cache"] == "hit" else "pending" for i in r.json()["items"])
            done, code = await asyncio.get_running_loop().run_in_executor(self._waits, self._wait, room)
            if done is None:
                return Outcome(start, str(code), meta, cache=cache, error=code)
            return Outcome(start, "202", meta, done - start, cache)

        out = await _guard(start, go())
        if not out.ok:
            self.rx.discard(room)
        return out


def make_deliverer(mode: str, *, receiver: Any = None, timeout: float = 300.0) -> Deliverer:
    if mode == "inline":
        return Inline()
    if mode == "pull":
        return Pull()
    if mode == "push":
        if receiver is None:
            raise ValueError("push delivery needs a receiver")
        return Push(receiver, timeout)
    raise ValueError(f"unknown delivery mode {mode!r}")
