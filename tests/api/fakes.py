# SPDX-License-Identifier: Apache-2.0
"""Loopback origins and resolvers for the URL fetcher tests."""
import asyncio
import ipaddress
import socket
import ssl
from urllib.parse import parse_qs, urlsplit

from epd_encoder.api.fetch import UrlFetcher

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
LOOPBACK = ipaddress.IPv4Address("127.0.0.1")


def only_loopback(ip) -> bool:
    return ip == LOOPBACK


class Resolver:
    """A DNS stand-in: name -> list of answers, or a list of successive answers."""

    def __init__(self, table: dict[str, list]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        entry = self.table.get(host)
        if entry is None:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        if entry and isinstance(entry[0], list):  # successive answers, last one repeats
            return entry.pop(0) if len(entry) > 1 else entry[0]
        return entry


class Origin:
    """A tiny HTTP/1.1 origin that records every connection and request."""

    def __init__(self, host: str = "127.0.0.1", ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.host, self.ssl_ctx = host, ssl_ctx
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.streamed = 0

    async def __aenter__(self) -> "Origin":
        self.server = await asyncio.start_server(self._handle, self.host, 0, ssl=self.ssl_ctx)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    def url(self, path: str, host: str = "images.example.test", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    async def _handle(self, reader, writer) -> None:
        self.connections += 1
        try:
            keep_alive = True  # the origin allows reuse, so the fetcher's refusal is observable
            while keep_alive:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                line, *lines = head.split("\r\n")
                target = line.split(" ")[1]
                headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines if h)}
                self.requests.append((target, headers))
                keep_alive = await self._route(target, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _route(self, target: str, w) -> bool:
        parts = urlsplit(target)
        path, query = parts.path, parse_qs(parts.query)
        seg = path.strip("/").split("/")

        def send(status: str, headers: dict[str, str], body: bytes = b"") -> None:
            hs = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            w.write(f"HTTP/1.1 {status}\r\n{hs}\r\n".encode() + body)

        if path == "/image":
            send("200 OK", {"Content-Length": str(len(IMAGE)), "Content-Type": "image/png"}, IMAGE)
        elif seg[0] == "sized":
            send("200 OK", {"Content-Length": seg[1]}, b"x" * int(seg[1]))
        elif seg[0] == "close":  # close-delimited body without Content-Length
            send("200 OK", {"Connection": "close"}, b"x" * int(seg[1]))
            await w.drain()
            return False
        elif path == "/chunked-forever":
            send("200 OK", {"Transfer-Encoding": "chunked"})
            chunk = b"%x\r\n%s\r\n" % (16384, b"y" * 16384)
            while self.streamed < 64 << 20:
                w.write(chunk)
                self.streamed += 16384
                await w.drain()
        elif path == "/lying-length":
            send("200 OK", {"Content-Length": str(10**9)}, b"z" * 10)
            await w.drain()
            await asyncio.sleep(5)
        elif path == "/drip":
            send("200 OK", {"Content-Length": "100"})
            for _ in range(100):
                w.write(b"d")
                await w.drain()
                await asyncio.sleep(0.05)
        elif seg[0] == "r":  # /r/n: a chain of n relative redirects, then the image
            n = int(seg[1])
            send("302 Found", {"Location": f"/r/{n - 1}" if n > 1 else "/image", "Content-Length": "0"})
        elif path == "/to":
            send("302 Found", {"Location": query["u"][0], "Content-Length": "0"})
        elif path == "/gzip":
            send("200 OK", {"Content-Encoding": "gzip", "Content-Length": "3"}, b"abc")
        elif path == "/no-location":
            send("302 Found", {"Content-Length": "0"})
        else:
            send("404 Not Found", {"Content-Length": "0"})
        await w.drain()
        return path not in ("/chunked-forever", "/lying-length", "/drip")


def make(resolver=None, **kw) -> UrlFetcher:
    opts = {
        "max_bytes": 1 << 20,
        "connect_timeout_s": 1.0,
        "total_timeout_s": 3.0,
        "resolver": resolver or Resolver({"images.example.test": ["127.0.0.1"]}),
        "address_policy": only_loopback,
    }
    opts.update(kw)
    return UrlFetcher(**opts)


def run(scenario, **origin_kw):
    async def main():
        async with Origin(**origin_kw) as origin:
            await scenario(origin)

    asyncio.run(main())
