# SPDX-License-Identifier: Apache-2.0
"""The fleet's shared cache tier (L3) on Mooncake Store (docs/cache.md, "The shared tier")."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from epd_encoder.config.base import _non_negative, _positive, opt

SCHEME = "mooncake"
P2P = "P2PHANDSHAKE"


@dataclass(frozen=True)
class SharedCacheConfig:
    shared_cache: str | None = opt(
        None,
        "mooncake://MASTER_HOST:MASTER_PORT[?metadata=URL]: look items up in, and write encodes to, "
        "the Mooncake Store this mooncake_master runs (no metadata: P2P handshake). Every server of a "
        "fleet given the same master and namespace turns the others' encodes into hits. Unset: off.",
        metavar="URL",
    )
    shared_cache_namespace: str = opt(
        "epd",
        "Key prefix: entries are <namespace>@id:<content key>. Give vLLM's build_embedding_namespace "
        "to let a vLLM consumer with cross_encoder_cache read them (docs/cache.md).",
    )
    shared_cache_deadline_ms: int = opt(
        500,
        "Deadline of one store read (a lookup). A miss on the request path waits at most this "
        "long for a slow store; lower bounds that wait, higher tolerates a slower network.",
    )
    shared_cache_put_deadline_ms: int = opt(
        5000, "Deadline of one store write. Writes run off the request path; a late one counts as a failure."
    )
    shared_cache_read_threads: int = opt(
        4,
        "Threads that run store reads. A read stuck in the store holds one until it returns; "
        "lookups queue for a thread within their deadline, at most 8 per thread (beyond: a miss, "
        "counted as busy). More serve more concurrent lookups of distinct keys.",
    )
    shared_cache_breaker_failures: int = opt(
        5,
        "Consecutive failed or late store operations that open the breaker: lookups and writes are "
        "then skipped (misses) until a probe after --shared-cache-breaker-cooldown succeeds.",
    )
    shared_cache_breaker_cooldown: float = opt(
        5.0, "Seconds the breaker stays open before one operation probes the store again."
    )
    shared_cache_write_queue: int = opt(
        64,
        "Encoded items waiting to be written to the store. Beyond it a write is dropped and "
        "counted: a slow store never holds back the tower (each queued item holds its output).",
    )
    shared_cache_segment_mb: int = opt(
        512,
        "Host memory this server lends to the store, in MiB. Entries placed there die with this "
        "server; 0 lends none (then store nodes, mooncake_client, must hold the entries).",
    )
    shared_cache_buffer_mb: int = opt(
        128,
        "Mooncake's local transfer buffer in MiB. Items larger than it are neither written nor read.",
    )
    shared_cache_replicas: int = opt(
        1, "Copies of each entry in the store, on distinct segments: more survive a node's loss, cost memory."
    )
    shared_cache_hostname: str = opt(
        "127.0.0.1",
        "Address other Mooncake clients reach this server's segment at: this node's address "
        "in a multi-node fleet.",
    )
    shared_cache_lease_s: float = opt(
        10.0,
        "The master's read lease (its -default_kv_lease_ttl, 10 s by default): a corrupt entry's "
        "removal, refused while a lease is held, is retried after this long.",
    )

    def __post_init__(self) -> None:
        _positive(self, "shared_cache_deadline_ms", "shared_cache_put_deadline_ms", "shared_cache_read_threads",
                  "shared_cache_breaker_failures", "shared_cache_breaker_cooldown", "shared_cache_write_queue",
                  "shared_cache_buffer_mb", "shared_cache_replicas", "shared_cache_lease_s")
        _non_negative(self, "shared_cache_segment_mb")
        if not self.shared_cache_namespace or "@id:" in self.shared_cache_namespace:
            raise ValueError("--shared-cache-namespace must be non-empty and may not contain '@id:'")
        if self.shared_cache is not None:
            _ = (self.master, self.metadata_server)  # parsed now: a bad URL fails at startup

    @property
    def enabled(self) -> bool:
        return self.shared_cache is not None

    @property
    def master(self) -> str:
        """``host:port`` of the mooncake_master."""
        url = urlsplit(self.shared_cache or "")
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme != SCHEME or not url.hostname or port is None or url.path not in ("", "/"):
            raise ValueError(f"--shared-cache must be {SCHEME}://MASTER_HOST:MASTER_PORT[?metadata=URL], "
                             f"got {self.shared_cache!r}")
        return f"{url.hostname}:{port}"

    @property
    def metadata_server(self) -> str:
        """The metadata server's URL, or P2PHANDSHAKE when the URL names none."""
        query = parse_qs(urlsplit(self.shared_cache or "").query, strict_parsing=False)
        unknown = set(query) - {"metadata"}
        if unknown:
            raise ValueError(f"--shared-cache takes only ?metadata=URL, got {sorted(unknown)}")
        values = query.get("metadata", [])
        if len(values) > 1:
            raise ValueError("--shared-cache takes one metadata URL")
        return values[0] if values else P2P
