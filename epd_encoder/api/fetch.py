# SPDX-License-Identifier: Apache-2.0
"""SSRF-safe fetching of image URLs on behalf of clients.

``UrlFetcher.fetch(url)`` returns the body of an http(s) URL, or raises one
of the typed errors:

- ``UnsupportedMedia``: the scheme (of the URL or of a redirect) is not allowed;
- ``InvalidInput``: malformed URL, credentials in the URL, a host outside the
  allowlist, a destination that is not a public address ("destination not
  allowed"), a name that does not resolve, a connection failure ("could not
  fetch"), a non-2xx status, a compressed body, or too many redirects;
- ``ImageTooLarge``: ``Content-Length`` or the streamed body exceeds ``max_bytes``;
- ``RequestTimeout``: resolving plus connecting took longer than
  ``connect_timeout_s``, or the whole fetch (every hop) longer than ``total_timeout_s``.

Invariants:
- the address checked is the address connected to: each hop's host is resolved
  once, by this module, every answer must pass the address policy, and the
  socket is opened to a vetted IP (Host header and TLS SNI/certificate name
  stay the hostname), so a DNS answer cannot be rebound between check and use;
- every redirect hop is parsed, checked and resolved again from scratch;
- environment proxies, cookies and connection reuse are never used: a pooled
  socket could carry a request for another hostname than its TLS name.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from epd_encoder.errors import (
    ConfigError,
    EncoderError,
    ImageTooLarge,
    InvalidInput,
    RequestTimeout,
    UnsupportedMedia,
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]
AddressPolicy = Callable[[IPAddress], bool]

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "instance-data"})
_BLOCKED_NAMES = _METADATA_NAMES | {"localhost"}
# Refused by name under the default policy; allow_private admits them (a cluster's
# ``svc.cluster.local``), the address policy still judging where they resolve.
_BLOCKED_SUFFIXES = (".localhost", ".internal", ".local", ".localdomain", ".home.arpa")
# Cloud instance-metadata endpoints stay blocked even with allow_private=True.
_METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200")
)
_IPV4_PART = re.compile(r"^(0[xX][0-9a-fA-F]*|[0-9]+)$")
_HEADERS = {"User-Agent": "epd-encoder", "Accept": "image/*", "Accept-Encoding": "identity"}


def is_public_address(ip: IPAddress) -> bool:
    """The default policy: only globally routable unicast addresses pass.

    Addresses that embed an IPv4 address (IPv4-mapped, NAT64 ``64:ff9b::/96``,
    6to4 ``2002::/16``, Teredo) are judged by the embedded address as well, so
    ``::ffff:127.0.0.1`` or ``64:ff9b::a9fe:a9fe`` are blocked like their IPv4 form.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public_address(ip.ipv4_mapped)
        if ip in _NAT64:
            return is_public_address(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour is not None and not is_public_address(ip.sixtofour):
            return False
        if ip.teredo is not None and not all(map(is_public_address, ip.teredo)):
            return False
        if ip.is_site_local:
            return False
    return ip.is_global and not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def _private_ok(ip: IPAddress) -> bool:
    v4 = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return not any(
        a.is_multicast or a.is_unspecified or a in _METADATA_ADDRESSES for a in (ip, v4) if a
    )


def parse_ipv4_number(host: str) -> ipaddress.IPv4Address | None:
    """Parse ``host`` the way ``inet_aton`` and WHATWG URLs do.

    Accepts 1 to 4 dot-separated parts, each decimal, octal (leading ``0``) or
    hex (``0x``), the last part filling the remaining bytes: ``2130706433``,
    ``0x7f.1`` and ``017700000001`` are all ``127.0.0.1``. Returns ``None`` when
    ``host`` is a name. Raises ``InvalidInput`` when the last label is numeric
    but the whole is not a valid address (such a host is never looked up in DNS).
    """
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if not labels or not _IPV4_PART.match(labels[-1]):
        return None
    if len(labels) > 4 or not all(_IPV4_PART.match(p) for p in labels):
        raise InvalidInput(f"invalid IPv4 address in URL: {host!r}")
    values = []
    for p in labels:
        if p[:2].lower() == "0x":
            values.append(int(p[2:] or "0", 16))
        elif len(p) > 1 and p.startswith("0"):
            try:
                values.append(int(p, 8))
            except ValueError as e:
                raise InvalidInput(f"invalid IPv4 address in URL: {host!r}") from e
        else:
            values.append(int(p))
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (5 - len(values)):
        raise InvalidInput(f"invalid IPv4 address in URL: {host!r}")
    n = last
    for i, v in enumerate(head):
        n |= v << (8 * (3 - i))
    return ipaddress.IPv4Address(n)


async def system_resolver(host: str, port: int) -> list[str]:
    """Resolve with the event loop's ``getaddrinfo`` (TCP answers, in order)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class _Target:
    url: httpx.URL
    host: str
    addresses: tuple[IPAddress, ...]
    is_name: bool


class UrlFetcher:
    """Fetches http(s) URLs for clients without letting them reach private networks.

    ``allow_hosts`` (optional) restricts hostnames to exact entries or
    ``*.suffix`` patterns; it never bypasses the address policy. The address
    policy is ``is_public_address`` unless ``address_policy`` is injected.
    ``allow_private=True`` admits loopback, RFC 1918, link-local and CGNAT
    addresses (never multicast, unspecified or cloud-metadata ones), and internal
    names other than the metadata ones: for tests and trusted in-cluster image
    stores only, since it removes SSRF protection.
    ``resolver`` replaces DNS (tests); ``ssl_context`` replaces the default
    certificate verification (a private CA, tests).
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        connect_timeout_s: float,
        total_timeout_s: float,
        max_redirects: int = 3,
        allowed_schemes: tuple[str, ...] = ("http", "https"),
        allow_hosts: frozenset[str] | None = None,
        resolver: Resolver | None = None,
        allow_private: bool = False,
        address_policy: AddressPolicy | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if max_bytes <= 0 or connect_timeout_s <= 0 or total_timeout_s <= 0:
            raise ConfigError("max_bytes and timeouts must be positive")
        if max_redirects < 0:
            raise ConfigError("max_redirects must be >= 0")
        schemes = frozenset(s.lower() for s in allowed_schemes)
        if not schemes or not schemes <= {"http", "https"}:
            raise ConfigError(f"allowed_schemes must be a subset of http, https: {allowed_schemes}")
        if allow_private and address_policy is not None:
            raise ConfigError("pass either allow_private or address_policy, not both")
        self._max_bytes = max_bytes
        self._too_large: type[EncoderError] = ImageTooLarge
        self._connect_timeout = connect_timeout_s
        self._total_timeout = total_timeout_s
        self._max_redirects = max_redirects
        self._schemes = schemes
        self._allow_hosts = (
            None if allow_hosts is None else frozenset(_norm_host(h) for h in allow_hosts)
        )
        self._resolve = resolver or system_resolver
        self._policy = address_policy or (_private_ok if allow_private else is_public_address)
        self._blocked_names = _METADATA_NAMES if allow_private else _BLOCKED_NAMES
        self._timeouts = {
            "connect": connect_timeout_s,
            "read": total_timeout_s,
            "write": total_timeout_s,
            "pool": connect_timeout_s,
        }
        self._transport = httpx.AsyncHTTPTransport(
            verify=ssl_context if ssl_context is not None else True,
            trust_env=False,
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=0),
            retries=0,
        )

    def limited(self, max_bytes: int, too_large: type[EncoderError]) -> "UrlFetcher":
        """The same fetcher (one transport, one policy) with another byte limit and its error."""
        if max_bytes <= 0:
            raise ConfigError("max_bytes must be positive")
        other = copy.copy(self)
        other._max_bytes, other._too_large = max_bytes, too_large
        return other

    async def fetch(self, url: str) -> bytes:
        """Return the body of ``url``, following at most ``max_redirects`` redirects."""
        try:
            return await asyncio.wait_for(self._follow(url), self._total_timeout)
        except asyncio.TimeoutError as e:
            raise RequestTimeout(f"fetching the image URL took over {self._total_timeout}s") from e

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> UrlFetcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _follow(self, raw: str) -> bytes:
        url = self._parse(raw)
        for hop in range(self._max_redirects + 1):
            target = await self._vet(url)
            location, body = await self._get(target)
            if location is None:
                return body
            if hop == self._max_redirects:
                break
            try:
                url = self._parse(str(url.join(location)))
            except httpx.InvalidURL as e:
                raise InvalidInput(f"invalid redirect location: {location[:200]!r}") from e
        raise InvalidInput(f"too many redirects (more than {self._max_redirects})")

    def _parse(self, raw: str) -> httpx.URL:
        try:
            url = httpx.URL(raw)
        except (httpx.InvalidURL, TypeError, ValueError) as e:
            raise InvalidInput(f"invalid image URL: {e}") from e
        if url.scheme not in self._schemes:
            raise UnsupportedMedia(f"URL scheme {url.scheme or '(none)'!r} is not allowed")
        if not url.raw_host:
            raise InvalidInput("image URL has no host")
        if url.userinfo:
            raise InvalidInput("credentials in image URLs are not allowed")
        return url

    async def _vet(self, url: httpx.URL) -> _Target:
        raw_host = url.raw_host.decode("ascii")
        literal = _literal_address(raw_host)
        host = str(literal) if literal is not None else _norm_host(raw_host)
        if self._allow_hosts is not None and not _host_allowed(host, self._allow_hosts):
            raise InvalidInput(f"destination not allowed: host {host!r} is not in the allowlist")
        if literal is not None:
            addresses: tuple[IPAddress, ...] = (literal,)
        else:
            internal = self._blocked_names is _BLOCKED_NAMES and host.endswith(_BLOCKED_SUFFIXES)
            if host in self._blocked_names or internal:
                raise InvalidInput(f"destination not allowed: {host!r} is an internal name")
            addresses = await self._lookup(host, url.port or (443 if url.scheme == "https" else 80))
        if not all(self._policy(a) for a in addresses):
            what = "is" if literal is not None else "resolves to"
            raise InvalidInput(f"destination not allowed: {host!r} {what} a non-public address")
        return _Target(url, host, addresses, literal is None)

    async def _lookup(self, host: str, port: int) -> tuple[IPAddress, ...]:
        try:
            answers = await asyncio.wait_for(self._resolve(host, port), self._connect_timeout)
        except asyncio.TimeoutError as e:
            raise RequestTimeout(f"resolving {host!r} took over {self._connect_timeout}s") from e
        except OSError as e:
            raise InvalidInput(f"could not fetch: cannot resolve {host!r}") from e
        try:
            addresses = tuple(ipaddress.ip_address(a.split("%", 1)[0]) for a in answers)
        except ValueError as e:
            raise InvalidInput(f"could not fetch: bad address for {host!r}") from e
        if not addresses:
            raise InvalidInput(f"could not fetch: cannot resolve {host!r}")
        return addresses

    async def _get(self, target: _Target) -> tuple[str | None, bytes]:
        extensions: dict = {"timeout": self._timeouts}
        if target.is_name:
            extensions["sni_hostname"] = target.host
        headers = {**_HEADERS, "Host": target.url.netloc.decode("ascii")}
        last: Exception | None = None
        for ip in target.addresses:
            request = httpx.Request(
                "GET", target.url.copy_with(host=str(ip)), headers=headers, extensions=extensions
            )
            try:
                response = await self._transport.handle_async_request(request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                last = e
                continue
            except httpx.TimeoutException as e:
                raise RequestTimeout(f"fetching {target.host!r} timed out") from e
            except httpx.HTTPError as e:
                raise InvalidInput(f"could not fetch from {target.host!r}") from e
            try:
                return await self._read(target, response)
            except httpx.TimeoutException as e:
                raise RequestTimeout(f"fetching {target.host!r} timed out") from e
            except httpx.HTTPError as e:
                raise InvalidInput(f"could not fetch from {target.host!r}: read failed") from e
            finally:
                await response.aclose()
        if isinstance(last, httpx.ConnectTimeout):
            raise RequestTimeout(f"connecting to {target.host!r} timed out") from last
        raise InvalidInput(f"could not fetch from {target.host!r}: connection failed") from last

    async def _read(self, target: _Target, response: httpx.Response) -> tuple[str | None, bytes]:
        status = response.status_code
        if status in _REDIRECT_STATUSES:
            location = response.headers.get("location")
            if not location:
                raise InvalidInput(f"could not fetch: HTTP {status} without a Location")
            return location, b""
        if not 200 <= status < 300:
            raise InvalidInput(f"could not fetch from {target.host!r}: HTTP {status}")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise InvalidInput(f"could not fetch: compressed body ({encoding}) not accepted")
        length = response.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_bytes:
            raise self._too_large(f"URL body is {length} bytes; the limit is {self._max_bytes}")
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > self._max_bytes:
                raise self._too_large(f"URL body exceeds the limit of {self._max_bytes} bytes")
        return None, bytes(body)


def _norm_host(host: str) -> str:
    return host.strip().lower().removesuffix(".")


def _literal_address(raw_host: str) -> IPAddress | None:
    if ":" in raw_host:
        try:
            return ipaddress.IPv6Address(raw_host.split("%", 1)[0])
        except ValueError as e:
            raise InvalidInput(f"invalid IPv6 address in URL: {raw_host!r}") from e
    return parse_ipv4_number(raw_host)


def _host_allowed(host: str, allowed: frozenset[str]) -> bool:
    if host in allowed:
        return True
    return any(p.startswith("*.") and host.endswith(p[1:]) for p in allowed)
