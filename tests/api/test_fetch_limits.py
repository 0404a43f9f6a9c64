# SPDX-License-Identifier: Apache-2.0
"""Redirects, size and time limits, and TLS of the URL fetcher."""
import asyncio
import shutil
import socket
import ssl
import subprocess
import time
from urllib.parse import quote

import pytest

from epd_encoder.errors import (
    ImageTooLarge,
    InvalidInput,
    RequestTimeout,
    UnsupportedMedia,
)
from tests.api.fakes import IMAGE, Resolver, make, run

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
