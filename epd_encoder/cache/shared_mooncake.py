# SPDX-License-Identifier: Apache-2.0
"""The shared tier's view of a Mooncake Store client: a few blocking calls, with Mooncake's
integer codes turned into outcomes. Every call blocks in C++ (the GIL released), so the tier
runs them on its own threads with deadlines (cache/shared_client.py)."""

from __future__ import annotations

import ctypes
import logging
import socket
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlsplit

from epd_encoder.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from epd_encoder.config.shared_cache import SharedCacheConfig

log = logging.getLogger(__name__)

# Mooncake 0.3.x ErrorCode values (types.h); Python sees the integers.
INVALID_PARAMS = -600  # get_into: the buffer is smaller than the object; put: larger than a segment
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706

Written = Literal["stored", "exists", "refused"]


class StoreError(RuntimeError):
    """The store failed (unreachable, RPC error or timeout inside Mooncake): counts against
    the breaker. Absent, too-large or leased objects are outcomes, not errors."""

    def __init__(self, op: str, code: int, detail: str = "") -> None:
        super().__init__(f"Mooncake {op} returned {code}{': ' + detail if detail else ''}")
        self.op, self.code = op, code


class Backend(Protocol):
    """What the shared tier asks of a store. Blocking; thread-safe."""

    def read(self, key: str, into: torch.Tensor) -> int | None:
        """Copy the object into ``into`` (uint8, contiguous, on the host): its length, or None
        when absent. ``INVALID_PARAMS`` when ``into`` is too small. Raises ``StoreError``."""
        ...

    def write(self, key: str, *parts: bytes | memoryview) -> Written:
        """Store the concatenation of ``parts``: "stored", "exists" (the object is left as it
        is: keys name content) or "refused" (too large for any segment). Raises ``StoreError``."""
        ...

    def remove(self, key: str) -> bool:
        """Remove the object; False while a reader holds its lease (retry after the lease).
        An absent object counts as removed. Raises ``StoreError``."""
        ...

    def close(self) -> None: ...


def reachable(address: str, timeout_s: float = 1.0) -> bool:
    """Whether ``host:port`` (or an http URL's) accepts a TCP connection: asked in Python, which
    releases the GIL while it waits, before a Mooncake call that would hold it."""
    if "://" in address:
        url = urlsplit(address)
        host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    else:
        host, _, text = address.rpartition(":")
        port = int(text)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


class MooncakeBackend:
    """Mooncake 0.3.13 holds the GIL in ``setup`` (~90 s against a dead master, measured) and in
    ``close`` and the client's destructor (~7-10 s when the master is gone), freezing every
    thread of the server: so setup only after the master answers, and no close without it."""

    def __init__(self, client: Any, replicas: int = 1, master: str = "") -> None:
        from mooncake.store import ReplicateConfig

        self.client, self.master = client, master
        self.replicate = ReplicateConfig()
        self.replicate.replica_num = replicas

    @classmethod
    def connect(cls, config: SharedCacheConfig) -> MooncakeBackend:
        """Set up a client against the config's master. Blocks: with the master down,
        Mooncake retries for about 90 s before it gives up (measured, 0.3.13)."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConfigError(f"--shared-cache needs the Mooncake wheel (mooncake-transfer-engine): {e}") from e
        for address in (config.master, config.metadata_server):
            if address != "P2PHANDSHAKE" and not reachable(address):
                raise StoreError("setup", -1, f"{address} does not answer")
        client = MooncakeDistributedStore()
        rc = client.setup(config.shared_cache_hostname, config.metadata_server,
                          config.shared_cache_segment_mb << 20, config.shared_cache_buffer_mb << 20,
                          "tcp", "", config.master)
        if rc != 0:
            raise StoreError("setup", rc)
        return cls(client, config.shared_cache_replicas, config.master)

    def read(self, key: str, into: torch.Tensor) -> int | None:
        n = int(self.client.get_into(key, into.data_ptr(), into.numel()))
        if n == OBJECT_NOT_FOUND:
            return None
        if n < 0 and n != INVALID_PARAMS:
            raise StoreError("get", n)
        return n

    def write(self, key: str, *parts: bytes | memoryview) -> Written:
        rc = int(self.client.put_parts(key, *parts, config=self.replicate))  # copies without the GIL
        if rc == OBJECT_ALREADY_EXISTS:
            return "exists"
        if rc == INVALID_PARAMS:
            return "refused"
        if rc != 0:
            raise StoreError("put", rc)
        return "stored"

    def remove(self, key: str) -> bool:
        rc = int(self.client.remove(key))
        if rc == OBJECT_HAS_LEASE:
            return False
        if rc not in (0, OBJECT_NOT_FOUND):
            raise StoreError("remove", rc)
        return True

    def close(self) -> None:
        if self.master and not reachable(self.master, 0.5):
            # Never destroyed either: its destructor would block the process's exit just the same.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.client))
            log.warning("shared cache: the master %s is gone; the Mooncake client is left open", self.master)
            return
        self.client.close()
