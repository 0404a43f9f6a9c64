# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder proxy`` and ``epd-encoder vllm-args``: an OpenAI-compatible front for vLLM (docs/proxy.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from epd_encoder.config.base import opt, _positive

ProxyMode = Literal["embeds", "uuid"]


def _check_url(flag: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{flag} {url!r}: expected an http(s)://host[:port] URL")


@dataclass(frozen=True)
class ProxyConfig:
    """The root of the proxy's tree (its own command, so its own root beside ServeConfig)."""

    encoder: str | None = opt(
        None, "URL of the encode tier (an `epd-encoder serve`, or the fleet's router). Required.",
        metavar="URL",
    )
    llm: tuple[str, ...] = opt(
        (), "URL of a vLLM OpenAI server; repeat the flag for several (comma-separated in the "
        "environment). Each request goes to the one with the fewest requests outstanding "
        "through this proxy, ties in turn: a spreader, not a router. Required.", metavar="URL",
    )
    mode: ProxyMode = opt(
        "embeds",
        "How vLLM gets each item: 'embeds' rewrites each media part into vLLM's image_embeds / "
        "video_embeds part carrying the tensors (vLLM needs --enable-mm-embeds; nothing shared, "
        "but the embedding crosses two hops as base64); 'uuid' has the encode tier keep the item "
        "where vLLM's EC connector reads it and tags the part with its content key as uuid "
        "(vLLM needs the connector: `epd-encoder vllm-args --mode uuid`).",
    )
    uuid_delivery: Literal["pull", "ec_store"] = opt(
        "pull",
        "With --mode uuid, where vLLM's connector finds the items: 'pull' keeps them in the encode "
        "tier (its --pull-ttl and --pull-store-mb bound how long), where vLLM's consumer loads them "
        "by key with our connector, epd_encoder.integrations.vllm: no shared filesystem, no store; "
        "'ec_store' has the tier write them into the store of vLLM's own connector (the tier's "
        "--ec-store-path or --ec-store-mooncake).",
    )
    ec_store_path: str | None = opt(
        None, "vllm-args with --uuid-delivery ec_store: the tier's --ec-store-path, the directory "
        "vLLM's ECExampleConnector reads (its shared_storage_path).", metavar="DIR",
    )
    encoder_down: Literal["fail", "local"] = opt(
        "fail",
        "When the encode tier is unreachable or answers 5xx: 'fail' answers 503 in OpenAI's "
        "error shape; 'local' forwards the request unchanged, so vLLM encodes the media with its "
        "own tower (only right when vLLM holds the true vision weights). The tier's 4xx (a "
        "corrupt image) is always the client's 4xx.",
    )
    encoder_api_key: str | None = opt(
        None, "Bearer key the encode tier requires (its --api-key). The client's Authorization "
        "header goes to vLLM unchanged.",
    )
    encoder_timeout: float = opt(
        60.0, "Seconds the encode tier may take for one request's media before the client gets 504.",
    )
    llm_timeout: float = opt(
        600.0,
        "Seconds vLLM may take to answer, or between two chunks of a stream. A long generation is "
        "fine; a stalled one ends here.",
    )
    host: str = opt("127.0.0.1", "Address to bind. Loopback by default; expose it deliberately.")
    port: int = opt(8080, "TCP port to listen on (0 picks a free one).")
    max_body_mb: int = opt(
        128, "Largest request body in MiB (413 beyond): media arrive inline as data: URLs.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = opt("info", "Lowest level logged.")

    def __post_init__(self) -> None:
        _positive(self, "encoder_timeout", "llm_timeout", "max_body_mb")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.encoder is not None:
            _check_url("--encoder", self.encoder)
        for url in self.llm:
            _check_url("--llm", url)

    def missing(self, need_llm: bool = True) -> str | None:
        """What a command needs and was not given, as one line; None if nothing."""
        if self.encoder is None:
            return "--encoder URL is required (the encode tier)"
        if need_llm and not self.llm:
            return "--llm URL is required (a vLLM OpenAI server; repeat for several)"
        return None
