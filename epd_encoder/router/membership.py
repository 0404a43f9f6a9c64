# SPDX-License-Identifier: Apache-2.0
"""The fleet's membership as Envoy takes it: ``--backend`` URLs, or an EDS resource file.

The file is Envoy's own format (a ``DiscoveryResponse`` holding one ``ClusterLoadAssignment``
for cluster ``encoders``), read and watched by Envoy itself; ``write_eds_file`` writes one
atomically (a rename in the watched directory), as Envoy needs to see a whole file.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

CLUSTER = "encoders"
_EDS_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


@dataclass(frozen=True)
class Backend:
    host: str
    port: int

    @classmethod
    def from_url(cls, url: str) -> Backend:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--backend {url!r}: expected http://host[:port] (the router speaks "
                             "plain HTTP to the servers, on the private network)")
        if parts.path not in ("", "/"):
            raise ValueError(f"--backend {url!r}: a server is a host and port, without a path")
        return cls(parts.hostname, parts.port or 80)


def eds_document(backends: list[Backend]) -> dict[str, Any]:
    """The EDS file naming ``backends`` (IP addresses: EDS does not resolve names)."""
    return {"resources": [{
        "@type": _EDS_TYPE,
        "cluster_name": CLUSTER,
        "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": b.host, "port_value": b.port}}}}
            for b in backends]}],
    }]}


def write_eds_file(path: Path, backends: list[Backend]) -> None:
    """Replace ``path`` by a rename, so the watching Envoy never reads half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".eds-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(eds_document(backends), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
