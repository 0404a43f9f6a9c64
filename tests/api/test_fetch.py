# SPDX-License-Identifier: Apache-2.0
import asyncio
import ipaddress
import shutil
import socket
import ssl
import subprocess
import time
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from epd_encoder.api.fetch import UrlFetcher, is_public_address, parse_ipv4_number
from epd_encoder.errors import (
    ConfigError,
    ImageTooLarge,
    InvalidInput,
    RequestTimeout,
    UnsupportedMedia,
)

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


# --- address policy and literal hosts -------------------------------------------------


@pytest.mark.parametrize(
    "addr",
    [
        "127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1",
        "0.0.0.0", "224.0.0.1", "255.255.255.255", "240.0.0.1", "192.0.2.1",
        "::1", "::", "fc00::1", "fd12::1", "fe80::1", "ff02::1", "::ffff:127.0.0.1",
        "::ffff:169.254.169.254", "::ffff:10.0.0.1", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe",
        "64:ff9b::a00:1", "64:ff9b:1::a00:1", "2002:7f00:1::", "2002:a9fe:a9fe::1", "2002:a00:1::",
        "::127.0.0.1", "2001:db8::1", "fec0::1",
    ],
)
def test_default_policy_blocks_non_public(addr):
    assert not is_public_address(ipaddress.ip_address(addr))


@pytest.mark.parametrize("addr", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_default_policy_admits_public(addr):
    assert is_public_address(ipaddress.ip_address(addr))


@pytest.mark.parametrize(
    "host,expect",
    [
        ("2130706433", "127.0.0.1"), ("0x7f.1", "127.0.0.1"), ("017700000001", "127.0.0.1"),
        ("0x7f000001", "127.0.0.1"), ("127.1", "127.0.0.1"), ("0177.0.0.01", "127.0.0.1"),
        ("0xA9.0xFE.0xA9.0xFE", "169.254.169.254"), ("10.1", "10.0.0.1"), ("8.8.8.8.", "8.8.8.8"),
        ("0", "0.0.0.0"), ("example.com", None), ("1.2.example", None),
    ],
)
def test_parse_ipv4_number_matches_inet_aton(host, expect):
    got = parse_ipv4_number(host)
    assert (None if got is None else str(got)) == expect
    if expect is not None and not host.endswith("."):
        assert socket.inet_ntoa(socket.inet_aton(host)) == expect


@pytest.mark.parametrize("host", ["256.1.1.1.1", "1.2.3.256", "4294967296", "09.1.1.1", "example.1"])
def test_parse_ipv4_number_rejects_numeric_garbage(host):
    with pytest.raises(InvalidInput):
        parse_ipv4_number(host)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/image", "http://2130706433:{port}/image", "http://0x7f.1:{port}/image",
        "http://017700000001:{port}/image", "http://0x7f000001:{port}/image", "http://127.1:{port}/image",
        "http://0177.0.0.1:{port}/image", "http://[::1]:{port}/image", "http://[::ffff:127.0.0.1]:{port}/image",
        "http://[::ffff:7f00:1]:{port}/image", "http://[64:ff9b::7f00:1]:{port}/image",
        "http://[2002:7f00:1::]:{port}/image", "http://0.0.0.0:{port}/image", "http://[::]:{port}/image",
        "http://169.254.169.254/latest/meta-data/", "http://[fe80::1%25lo]:{port}/image",
        "http://localhost:{port}/image", "http://LocalHost.:{port}/image", "http://a.localhost:{port}/image",
        "http://metadata.google.internal/computeMetadata/v1/", "http://printer.local/",
    ],
)
def test_default_policy_never_touches_loopback_or_dns_for_blocked_literals(url):
    async def scenario(origin):
        resolver = Resolver({})
        async with make(resolver, address_policy=None) as f:
            with pytest.raises(InvalidInput):
                await f.fetch(url.format(port=origin.port))
        assert origin.connections == 0 and resolver.calls == []

    run(scenario)


def test_default_policy_blocks_a_name_that_resolves_to_loopback():
    async def scenario(origin):
        resolver = Resolver({"images.example.test": ["127.0.0.1"]})
        async with make(resolver, address_policy=None) as f:
            with pytest.raises(InvalidInput, match="destination not allowed.*non-public"):
                await f.fetch(origin.url("/image"))
        assert resolver.calls == ["images.example.test"] and origin.connections == 0

    run(scenario)


def test_any_blocked_answer_blocks_the_host():
    async def scenario(origin):
        resolver = Resolver({"images.example.test": ["127.0.0.1", "10.0.0.1"]})
        async with make(resolver) as f:
            with pytest.raises(InvalidInput, match="destination not allowed"):
                await f.fetch(origin.url("/image"))
        assert origin.connections == 0

    run(scenario)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://images.example.test/a.png", "gopher://x/", "data:image/png;base64,AA==", "ws://x/"])
def test_non_http_schemes_are_unsupported(url):
    async def scenario(origin):
        async with make() as f:
            with pytest.raises(UnsupportedMedia):
                await f.fetch(url)

    run(scenario)


def test_https_only_scheme_list_rejects_http():
    async def scenario(origin):
        async with make(allowed_schemes=("https",)) as f:
            with pytest.raises(UnsupportedMedia):
                await f.fetch(origin.url("/image"))
        assert origin.connections == 0

    run(scenario)


@pytest.mark.parametrize("url", ["http://user:pw@images.example.test/image", "http:///nohost", "http://exa mple.com/", "not a url"])
def test_malformed_urls_and_credentials_are_invalid(url):
    async def scenario(origin):
        async with make() as f:
            with pytest.raises((InvalidInput, UnsupportedMedia)):
                await f.fetch(url)
        assert origin.connections == 0

    run(scenario)


def test_allowlist_restricts_hosts_but_never_bypasses_the_address_policy():
    async def scenario(origin):
        resolver = Resolver({"images.example.test": ["127.0.0.1"], "evil.example.test": ["127.0.0.1"]})
        async with make(resolver, allow_hosts=frozenset({"*.example.test"})) as f:
            assert await f.fetch(origin.url("/image")) == IMAGE
        async with make(resolver, allow_hosts=frozenset({"images.example.test."})) as f:
            assert await f.fetch(origin.url("/image", host="IMAGES.example.test")) == IMAGE
            with pytest.raises(InvalidInput, match="allowlist"):
                await f.fetch(origin.url("/image", host="evil.example.test"))
        async with make(resolver, address_policy=None, allow_hosts=frozenset({"images.example.test"})) as f:
            with pytest.raises(InvalidInput, match="non-public"):
                await f.fetch(origin.url("/image"))
        assert origin.connections == 2

    run(scenario)


def test_config_is_validated():
    with pytest.raises(ConfigError):
        make(max_bytes=0)
    with pytest.raises(ConfigError):
        make(allowed_schemes=("http", "file"))
    with pytest.raises(ConfigError):
        make(allow_private=True)  # together with address_policy
    with pytest.raises(ConfigError):
        make(max_redirects=-1)


def test_allow_private_still_blocks_metadata_and_unspecified():
    async def scenario(origin):
        async with make(address_policy=None, allow_private=True) as f:
            assert await f.fetch(origin.url("/image")) == IMAGE
            for url in ("http://169.254.169.254/", "http://[::ffff:169.254.169.254]/", "http://0.0.0.0/"):
                with pytest.raises(InvalidInput, match="destination not allowed"):
                    await f.fetch(url)

    run(scenario)


# --- pinning the vetted address (DNS rebinding) ----------------------------------------


def test_connects_to_the_vetted_ip_with_the_original_host_header():
    async def scenario(origin):
        # the name only exists in the injected resolver: any second lookup by the OS would fail
        resolver = Resolver({"images.example.test": ["127.0.0.1"]})
        async with make(resolver) as f:
            assert await f.fetch(origin.url("/image")) == IMAGE
        assert resolver.calls == ["images.example.test"]
        (path, headers), = origin.requests
        assert path == "/image" and headers["host"] == f"images.example.test:{origin.port}"
        assert headers["accept-encoding"] == "identity"

    run(scenario)


def test_dns_rebinding_answer_is_never_connected_to():
    async def scenario(origin):
        async with Origin(host="127.0.0.2") as attacker:
            answers = {"images.example.test": [["127.0.0.1"], ["127.0.0.2"]]}
            resolver = Resolver(answers)
            async with make(resolver) as f:
                assert await f.fetch(origin.url("/image")) == IMAGE
                # a redirect back to the same name is re-resolved; the rebound answer is refused
                back = quote(origin.url("/image"), safe="")
                with pytest.raises(InvalidInput, match="destination not allowed"):
                    await f.fetch(origin.url(f"/to?u={back}"))
            assert resolver.calls == ["images.example.test"] * 2
            assert attacker.connections == 0
            assert [p for p, _ in origin.requests] == ["/image"]

    run(scenario)


def test_next_vetted_address_is_tried_when_one_refuses():
    async def scenario(origin):
        resolver = Resolver({"images.example.test": ["127.0.0.3", "127.0.0.1"]})
        policy = lambda ip: str(ip) in ("127.0.0.1", "127.0.0.3")
        async with make(resolver, address_policy=policy) as f:  # nothing listens on .3
            assert await f.fetch(origin.url("/image")) == IMAGE
        assert origin.connections == 1

    run(scenario)


def test_environment_proxies_are_ignored(monkeypatch):
    async def scenario(origin):
        async with Origin() as proxy:
            for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
                monkeypatch.setenv(var, f"http://127.0.0.1:{proxy.port}")
            async with make() as f:
                assert await f.fetch(origin.url("/image")) == IMAGE
            assert proxy.connections == 0 and origin.connections == 1

    run(scenario)


# --- redirects ---------------------------------------------------------------------------


def test_redirect_chain_within_cap_is_followed():
    async def scenario(origin):
        async with make(max_redirects=3) as f:
            assert await f.fetch(origin.url("/r/3")) == IMAGE
        assert [p for p, _ in origin.requests] == ["/r/3", "/r/2", "/r/1", "/image"]

    run(scenario)


def test_redirect_cap_is_enforced():
    async def scenario(origin):
        async with make(max_redirects=2) as f:
            with pytest.raises(InvalidInput, match="too many redirects"):
                await f.fetch(origin.url("/r/3"))
        async with make(max_redirects=0) as f:
            with pytest.raises(InvalidInput, match="too many redirects"):
                await f.fetch(origin.url("/r/1"))
        assert len(origin.requests) == 4

    run(scenario)


def test_redirect_to_another_name_is_resolved_again():
    async def scenario(origin):
        resolver = Resolver({"images.example.test": ["127.0.0.1"], "cdn.example.test": ["127.0.0.1"]})
        async with make(resolver) as f:
            to = quote(origin.url("/image", host="cdn.example.test"), safe="")
            assert await f.fetch(origin.url(f"/to?u={to}")) == IMAGE
        assert resolver.calls == ["images.example.test", "cdn.example.test"]
        assert origin.requests[1][1]["host"] == f"cdn.example.test:{origin.port}"

    run(scenario)


@pytest.mark.parametrize(
    "location",
    [
        "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/", "http://[::1]:{port}/image",
        "http://[::ffff:127.0.0.1]:{port}/image", "http://[::ffff:7f00:1]:{port}/image",
        "http://2130706434:{port}/image", "http://0xa9fea9fe/", "http://0x7f.2:{port}/image",
        "http://127.0.0.2:{port}/image",
        "http://internal.example.test:{port}/image", "http://localhost:{port}/image",
        "http://metadata.google.internal/computeMetadata/v1/",
    ],
)
def test_every_redirect_hop_is_rechecked(location):
    async def scenario(origin):
        resolver = Resolver({"images.example.test": ["127.0.0.1"], "internal.example.test": ["10.0.0.5"]})
        async with make(resolver) as f:
            to = quote(location.format(port=origin.port), safe="")
            with pytest.raises(InvalidInput, match="destination not allowed"):
                await f.fetch(origin.url(f"/to?u={to}"))
        assert [p for p, _ in origin.requests] == [f"/to?u={to}"]

    run(scenario)


@pytest.mark.parametrize("host", ["2130706433", "0x7f.1", "017700000001", "127.1"])
def test_numeric_host_is_connected_to_exactly_the_address_checked(host):
    async def scenario(origin):
        async with make(Resolver({})) as f:  # the policy admits exactly 127.0.0.1
            assert await f.fetch(origin.url("/image", host=host)) == IMAGE
        assert origin.requests[0][1]["host"] == f"{host}:{origin.port}"

    run(scenario)


def test_redirect_to_a_non_http_scheme_is_refused():
    async def scenario(origin):
        async with make() as f:
            with pytest.raises(UnsupportedMedia):
                await f.fetch(origin.url("/to?u=file%3A%2F%2F%2Fetc%2Fpasswd"))

    run(scenario)


def test_non_2xx_and_broken_redirects_are_invalid_input():
    async def scenario(origin):
        async with make() as f:
            with pytest.raises(InvalidInput, match="HTTP 404"):
                await f.fetch(origin.url("/missing"))
            with pytest.raises(InvalidInput, match="Location"):
                await f.fetch(origin.url("/no-location"))
            with pytest.raises(InvalidInput, match="compressed"):
                await f.fetch(origin.url("/gzip"))

    run(scenario)


def test_unresolvable_and_refused_are_could_not_fetch():
    async def scenario(origin):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
        s.close()
        async with make() as f:
            with pytest.raises(InvalidInput, match="cannot resolve") as e:
                await f.fetch(origin.url("/image", host="nowhere.example.test"))
            assert isinstance(e.value.__cause__, OSError)
            with pytest.raises(InvalidInput, match="could not fetch") as e:
                await f.fetch(f"http://images.example.test:{closed_port}/image")
            assert e.value.__cause__ is not None and not isinstance(e.value, type(e.value.__cause__))

    run(scenario)


# --- size and time limits ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sized", "close"])
def test_body_of_exactly_max_bytes_passes_and_one_more_fails(kind):
    async def scenario(origin):
        async with make(max_bytes=5000) as f:
            assert await f.fetch(origin.url(f"/{kind}/5000")) == b"x" * 5000
            with pytest.raises(ImageTooLarge):
                await f.fetch(origin.url(f"/{kind}/5001"))

    run(scenario)


def test_too_large_content_length_is_rejected_before_reading():
    async def scenario(origin):
        async with make(max_bytes=5000) as f:
            t = time.monotonic()
            with pytest.raises(ImageTooLarge, match="1000000000"):
                await f.fetch(origin.url("/lying-length"))
            assert time.monotonic() - t < 1.0  # the server holds the body for 5 s

    run(scenario)


def test_unbounded_stream_stops_just_past_the_limit():
    async def scenario(origin):
        async with make(max_bytes=100_000) as f:
            with pytest.raises(ImageTooLarge):
                await f.fetch(origin.url("/chunked-forever"))
        await asyncio.sleep(0.05)
        assert origin.streamed < 16 << 20  # the reader hung up long before the 64 MiB end

    run(scenario)


def test_total_timeout_bounds_a_slow_drip():
    async def scenario(origin):
        async with make(total_timeout_s=0.4) as f:
            t = time.monotonic()
            with pytest.raises(RequestTimeout):
                await f.fetch(origin.url("/drip"))
            assert 0.3 < time.monotonic() - t < 1.5

    run(scenario)


def test_total_timeout_spans_all_redirect_hops():
    async def scenario(origin):
        async def slow(host, port):
            await asyncio.sleep(0.15)
            return ["127.0.0.1"]

        async with make(slow, total_timeout_s=0.5, max_redirects=5) as f:
            with pytest.raises(RequestTimeout):
                await f.fetch(origin.url("/r/5"))
        assert 1 <= len(origin.requests) < 6

    run(scenario)


def test_connect_timeout_bounds_dns():
    async def scenario(origin):
        async def hang(host, port):
            await asyncio.sleep(10)

        async with make(hang, connect_timeout_s=0.2, total_timeout_s=5) as f:
            t = time.monotonic()
            with pytest.raises(RequestTimeout, match="resolving"):
                await f.fetch(origin.url("/image"))
            assert time.monotonic() - t < 1.5

    run(scenario)


# --- TLS: SNI and certificate name are the hostname, not the pinned IP -----------------


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "1",
         "-subj", "/CN=images.example.test", "-addext", "subjectAltName=DNS:images.example.test"],
        check=True, capture_output=True,
    )
    return d / "cert.pem", d / "key.pem"


def test_https_uses_hostname_for_sni_and_verification(cert):
    certfile, keyfile = cert
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(certfile, keyfile)
    seen_sni: list[str | None] = []
    server_ctx.sni_callback = lambda sock, name, ctx: seen_sni.append(name)
    client_ctx = ssl.create_default_context(cafile=str(certfile))

    async def scenario(origin):
        resolver = Resolver({"images.example.test": ["127.0.0.1"], "other.example.test": ["127.0.0.1"]})
        async with make(resolver, ssl_context=client_ctx) as f:
            assert await f.fetch(origin.url("/image", scheme="https")) == IMAGE
            with pytest.raises(InvalidInput, match="could not fetch"):  # cert is not for this name
                await f.fetch(origin.url("/image", host="other.example.test", scheme="https"))
        assert seen_sni == ["images.example.test", "other.example.test"]
        assert [p for p, _ in origin.requests] == ["/image"]

    run(scenario, ssl_ctx=server_ctx)


def test_connect_timeout_bounds_a_stalled_tls_handshake(cert):
    async def scenario(origin):
        async def silent(reader, writer):
            await asyncio.sleep(3)
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            ctx = ssl.create_default_context(cafile=str(cert[0]))
            async with make(ssl_context=ctx, connect_timeout_s=0.2, total_timeout_s=5) as f:
                t = time.monotonic()
                with pytest.raises(RequestTimeout, match="connecting"):
                    await f.fetch(f"https://images.example.test:{port}/image")
                assert time.monotonic() - t < 1.5
        finally:
            server.close()

    run(scenario)


def test_concurrent_fetches_share_one_fetcher():
    async def scenario(origin):
        async with make() as f:
            bodies = await asyncio.gather(*(f.fetch(origin.url(p)) for p in ["/image", "/r/2", "/sized/10"] * 4))
        assert bodies == [IMAGE, IMAGE, b"x" * 10] * 4
        assert origin.connections == len(origin.requests) == 4 * 5  # no connection reuse

    run(scenario)
