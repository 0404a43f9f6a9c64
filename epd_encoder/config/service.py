# SPDX-License-Identifier: Apache-2.0
"""How the server meets its clients and peers: URL fetching, auth, HTTP, push, logs, tensor parallelism."""

from __future__ import annotations
from dataclasses import dataclass
from typing import Literal

from epd_encoder.config.base import opt, _positive, _non_negative


@dataclass(frozen=True)
class FetchConfig:
    allow_url_fetch: bool = opt(
        False,
        "Allow http(s) image URLs. Off by default: fetching for clients is an SSRF surface. "
        "When on, private, loopback, link-local and metadata addresses stay blocked "
        "(see --fetch-allow-private).",
    )
    fetch_timeout: float = opt(10.0, "Total seconds allowed for one URL fetch, redirects included.")
    fetch_max_redirects: int = opt(3, "Redirect hops followed; each hop is re-checked.")
    fetch_allow_hosts: str | None = opt(
        None,
        "Comma-separated host names a URL (and each redirect hop) may name: exact, or '*.suffix'. "
        "Unset allows any. It only narrows: the address policy still applies.",
    )
    fetch_allow_private: bool = opt(
        False,
        "Also fetch from private, loopback, link-local and CGNAT addresses and internal names "
        "(svc.cluster.local): for an in-cluster image store. Cloud-metadata addresses and names "
        "stay blocked, but most SSRF protection is gone: pair it with --fetch-allow-hosts.",
    )

    def __post_init__(self) -> None:
        _positive(self, "fetch_timeout")
        _non_negative(self, "fetch_max_redirects")
        if (self.fetch_allow_private or self.fetch_allow_hosts is not None) and not self.allow_url_fetch:
            raise ValueError("--fetch-allow-private and --fetch-allow-hosts need --allow-url-fetch")
        if self.fetch_allow_hosts is not None and not self.allow_hosts:
            raise ValueError("--fetch-allow-hosts names no host")

    @property
    def allow_hosts(self) -> frozenset[str] | None:
        """``--fetch-allow-hosts`` as the fetcher takes it; None allows any host."""
        if self.fetch_allow_hosts is None:
            return None
        return frozenset(h.strip() for h in self.fetch_allow_hosts.split(",") if h.strip())


@dataclass(frozen=True)
class AuthConfig:
    api_key: str | None = opt(
        None, "Require 'Authorization: Bearer KEY' (constant-time compare). Off when unset."
    )
    protect_health: bool = opt(False, "Require the key for /health too (load balancers then need it).")
    protect_metrics: bool = opt(False, "Require the key for /metrics too.")
    public_docs: bool = opt(
        False,
        "Serve /docs, /redoc and /openapi.json without the key. Convenient for browsing "
        "(a browser sends no bearer token), but shows the API surface to anyone who can connect.",
    )


@dataclass(frozen=True)
class HttpConfig:
    header_timeout: float = opt(
        60.0,
        "Seconds a connection has to send a complete request head, counted from its first byte "
        "(or from accept for a new connection); then it is closed (408 if it sent part of a head). "
        "Shorter frees slowloris-held connections sooner; too short cuts off clients on slow links.",
    )
    body_timeout: float = opt(
        60.0,
        "Seconds a request body has to arrive in full once its head is in; then 408 and the "
        "connection is closed. Bounds a trickled body; it must cover --max-body-mb at your "
        "clients' slowest upload rate.",
    )
    send_timeout: float = opt(
        60.0,
        "Seconds a client may take none of a response's bytes while more wait to be sent (the "
        "write buffer is full); then the connection is aborted, as nginx's send_timeout. A slow "
        "reader that keeps taking bytes is never cut. Bounds a client that asks and never reads.",
    )
    keep_alive_timeout: float = opt(
        75.0,
        "Seconds an idle keep-alive connection stays open between requests. Keep it above the "
        "gateway's own idle timeout (or the gateway races our close); each idle connection holds "
        "an fd, and idle ones are closed first when --max-connections is reached.",
    )
    max_connections: int = opt(
        0,
        "Open client connections at most; beyond it a new connection gets 503 and is closed, after "
        "idle keep-alive connections are reclaimed. 0 is half the open-file limit: asyncio accepts "
        "a burst (up to the listen backlog, a quarter of the limit) before counting it, and model "
        "files, push sockets and logs need fds too. Above that, accept() can run out of fds.",
    )

    def __post_init__(self) -> None:
        _positive(self, "header_timeout", "body_timeout", "send_timeout", "keep_alive_timeout")
        _non_negative(self, "max_connections")  # 0 derives it from the open-file limit


@dataclass(frozen=True)
class PushConfig:
    bootstrap_timeout: float = opt(
        10.0, "Seconds a push receiver has to accept a room before it fails and is freed."
    )
    transfer_timeout: float = opt(
        30.0, "Seconds for a room's bytes to be written and acknowledged before it fails."
    )
    room_record_ttl: float = opt(
        300.0, "Seconds a finished room's status stays queryable at GET /v1/rooms/{room}?receiver=..."
    )
    push_allowed_targets: str | None = opt(
        None,
        "Comma-separated CIDRs, host names or 'ipc' that push receivers (and their data ports) "
        "may be on. Unset allows any: clients then choose where this server connects, so set "
        "it wherever the API is reachable by untrusted clients.",
    )
    max_rooms_per_peer: int = opt(
        64,
        "Queued rooms per receiver endpoint. A slow receiver fills only its own queue; beyond "
        "it its rooms fail with 'overloaded' instead of stalling the tower or other peers.",
    )
    max_push_peers: int = opt(
        256,
        "Receiver endpoints this server holds a channel to at once (a thread, a socket and a few "
        "fds each). A push that needs one more is refused with 429 before it is preprocessed, "
        "never accepted with 202 and then failed.",
    )
    proven_peer_slots: int = opt(
        64,
        "Of --max-push-peers, the slots only receivers that have answered this server (completed "
        "a handshake) may take, so pushes to endpoints that never answer cannot lock out working "
        "receivers. Larger protects more working receivers; the rest serve new ones.",
    )
    push_peer_idle_timeout: float = opt(
        60.0,
        "Seconds a receiver channel with no room stays open for the next push. A channel whose "
        "receiver never answered (its last Offer timed out, or its rooms failed before any Offer) "
        "closes as soon as it holds no room.",
    )

    def __post_init__(self) -> None:
        _positive(self, "bootstrap_timeout", "transfer_timeout", "room_record_ttl", "max_rooms_per_peer",
                  "max_push_peers", "push_peer_idle_timeout")
        _non_negative(self, "proven_peer_slots")
        if self.proven_peer_slots >= self.max_push_peers:  # new receivers could never be proven
            raise ValueError(f"--proven-peer-slots ({self.proven_peer_slots}) must be under "
                             f"--max-push-peers ({self.max_push_peers})")

    @property
    def allowed_targets(self) -> list[str] | None:
        if self.push_allowed_targets is None:
            return None
        return [e.strip() for e in self.push_allowed_targets.split(",") if e.strip()]


@dataclass(frozen=True)
class LogConfig:
    """One format, with timestamps, for our logs and uvicorn's (server/logs.py)."""

    log_level: Literal["debug", "info", "warning", "error"] = opt(
        "info", "Lowest level logged, ours and uvicorn's. Health probes and /metrics scrapes "
        "are access-logged only at debug.",
    )
    log_format: Literal["text", "json"] = opt(
        "text", "'text': one human-readable line per record; 'json': one JSON object per line "
        "(ts, level, logger, message, exception) for log collectors.",
    )


@dataclass(frozen=True)
class TPConfig:
    """Tensor parallelism: one server over N local rank processes (docs/operations.md)."""

    tp: int = opt(
        1,
        "Ranks of the vision tower: 1 runs it in this process; N > 1 spawns N-1 rank processes "
        "(gloo on loopback; on CUDA rank r uses cuda:r), each with --threads/N intra-op threads. Rank "
        "0 (this process) keeps HTTP, preprocessing, the cache and the scheduler.",
    )
    tp_mode: Literal["weights", "data"] = opt(
        "weights",
        "With --tp > 1: 'weights' shards the tower (attention heads and MLP split over the ranks, "
        "an all-reduce per block; each rank holds ~1/N of the weights; the head count must divide "
        "by N); 'data' gives each rank a full replica and a cost-balanced share of each batch "
        "(whole items), usually faster for a ViT when the weights fit on one device.",
    )
    tp_timeout: float = opt(
        30.0,
        "Seconds any collective between the ranks may take before the group is declared failed "
        "(a hung rank). It must exceed the longest forward of one batch; a rank that dies is "
        "seen within --tp-heartbeat regardless. A failed group answers 503 and the server exits 1.",
    )
    tp_heartbeat: float = opt(
        1.0,
        "The longest an idle rank waits for a message: rank 0 sends a heartbeat (one small "
        "broadcast) when nothing went out for half of it, and checks the ranks' liveness as "
        "often. Must be under --tp-timeout.",
    )

    def __post_init__(self) -> None:
        _positive(self, "tp", minimum=1, strict=False)
        _positive(self, "tp_timeout", "tp_heartbeat")
        if self.tp_heartbeat >= self.tp_timeout:  # tp/group.py keeps every idle gap under the heartbeat
            raise ValueError(f"--tp-heartbeat ({self.tp_heartbeat:g}) must be under --tp-timeout "
                             f"({self.tp_timeout:g}), or an idle rank would time out")
