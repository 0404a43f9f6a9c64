# SPDX-License-Identifier: Apache-2.0
"""Which receivers an encode server may push to.

Clients name the push targets, so without a policy an API client could make
the encoder connect to (and write into) any host it can reach, the same hole
as an unchecked image URL. Receivers normally live on the cluster's private
network, so unlike URL fetching the default cannot block private addresses;
operators list what is allowed instead (``--push-allowed-targets``).
"""

from __future__ import annotations

import ipaddress
from typing import Sequence
from urllib.parse import urlsplit

from epd_encoder.errors import InvalidInput
from epd_encoder.transfer.control import Delivery


def endpoint_host(endpoint: str) -> str:
    """``tcp://host:port`` → ``host``; ``ipc://path`` → ``"ipc"``."""
    if endpoint.startswith("ipc://"):
        return "ipc"
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname:
        raise InvalidInput(f"push endpoint {endpoint!r} is not tcp://host:port or ipc://path")
    return parts.hostname


class TargetPolicy:
    """``allowed``: CIDRs, host names (exact, case-insensitive) or ``ipc``; ``None`` allows any."""

    def __init__(self, allowed: Sequence[str] | None = None) -> None:
        self.any = allowed is None
        self.names: set[str] = set()
        self.nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allowed or ():
            entry = entry.strip().lower()
            if not entry:
                continue
            try:
                self.nets.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.add(entry)

    def allows(self, host: str) -> bool:
        if self.any:
            return True
        host = host.lower()
        if host in self.names:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self.nets)

    def check(self, delivery: Delivery) -> None:
        """Raise ``InvalidInput`` unless every target, and every data address it names, is allowed."""
        for t in delivery.targets:
            hosts = [endpoint_host(t.endpoint)]
            data_host = t.info.get("data_host")
            if data_host is not None:  # the tcp plane's out-of-band data address
                hosts.append(str(data_host))
            for host in hosts:
                if not self.allows(host):
                    raise InvalidInput(f"push target {host!r} (rank {t.rank}) is not allowed on this server")
