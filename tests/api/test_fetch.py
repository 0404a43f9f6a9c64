# SPDX-License-Identifier: Apache-2.0
"""Address policy, literal hosts and pinning of the vetted address."""
import ipaddress
import socket
from urllib.parse import quote

import pytest

from epd_encoder.api.fetch import is_public_address, parse_ipv4_number
from epd_encoder.errors import (
    ConfigError,
    InvalidInput,
    UnsupportedMedia,
)
from tests.api.fakes import IMAGE, Origin, Resolver, make, run

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


def test_allow_private_admits_cluster_names_but_never_metadata_names():
    async def scenario(origin):
        resolver = Resolver({"images.store.svc.cluster.local": ["127.0.0.1"], "localhost": ["127.0.0.1"],
                             "metadata.google.internal": ["127.0.0.1"]})
        url = f"http://images.store.svc.cluster.local:{origin.port}/image"
        async with make(resolver, address_policy=None) as f:  # the default policy refuses the name unresolved
            with pytest.raises(InvalidInput, match="internal name"):
                await f.fetch(url)
        assert resolver.calls == []
        async with make(resolver, address_policy=None, allow_private=True) as f:
            assert await f.fetch(url) == IMAGE
            assert await f.fetch(f"http://localhost:{origin.port}/image") == IMAGE
            with pytest.raises(InvalidInput, match="internal name"):
                await f.fetch(f"http://metadata.google.internal:{origin.port}/computeMetadata/v1/")
        assert "metadata.google.internal" not in resolver.calls

    run(scenario)
