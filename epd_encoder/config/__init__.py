# SPDX-License-Identifier: Apache-2.0
"""One frozen config tree; the CLI is generated from it.

Each leaf field carries its help text (the trade-off it controls) in its
metadata; epd_encoder/flags.py turns every leaf into a flag, an environment
variable and a TOML key, and builds the frozen tree back (validation runs in
``__post_init__``, so a bad value fails before anything loads; messages name
the flag). Derived values are properties. Units are in the names: memory budgets
and the body cap are MiB (``_mb``), an encoded item's cap is bytes (``_bytes``), times
are seconds unless ``_ms``. The environment is read only in flags.py.

The sections live by concern (``engine``, ``model``, ``service``); the root,
``ServeConfig``, is here, and every section is importable from here. ``ProxyConfig``
(``proxy``) is the root of another command, ``epd-encoder proxy``.
"""

from __future__ import annotations

from dataclasses import dataclass

from epd_encoder.config.base import MiB, opt, sub, _non_negative, _positive
from epd_encoder.config.ec_store import ECStoreConfig
from epd_encoder.config.engine import CacheConfig, EngineConfig, SchedulerConfig
from epd_encoder.config.model import LimitsConfig, ModelConfig, VideoConfig
from epd_encoder.config.proxy import ProxyConfig
from epd_encoder.config.shared_cache import SharedCacheConfig
from epd_encoder.config.service import AuthConfig, FetchConfig, HttpConfig, LogConfig, PushConfig, TPConfig

__all__ = ["MiB", "opt", "sub", "ServeConfig", "SchedulerConfig", "CacheConfig", "EngineConfig", "ModelConfig",
           "LimitsConfig", "VideoConfig", "FetchConfig", "AuthConfig", "HttpConfig", "PushConfig", "LogConfig",
           "TPConfig", "ProxyConfig", "SharedCacheConfig", "add_arguments", "from_namespace"]


@dataclass(frozen=True)
class ServeConfig:
    model: ModelConfig = sub(ModelConfig)
    engine: EngineConfig = sub(EngineConfig)
    limits: LimitsConfig = sub(LimitsConfig)
    video: VideoConfig = sub(VideoConfig)
    fetch: FetchConfig = sub(FetchConfig)
    auth: AuthConfig = sub(AuthConfig)
    push: PushConfig = sub(PushConfig)
    ec_store: ECStoreConfig = sub(ECStoreConfig)
    shared: SharedCacheConfig = sub(SharedCacheConfig)
    http: HttpConfig = sub(HttpConfig)
    log: LogConfig = sub(LogConfig)
    parallel: TPConfig = sub(TPConfig)
    host: str = opt("127.0.0.1", "Address to bind. Loopback by default; expose it deliberately.")
    port: int = opt(8000, "TCP port to listen on (0 picks a free one).")
    max_body_mb: int = opt(
        128, "Largest request body in MiB (413 beyond), counted while it streams in."
    )
    request_timeout: float = opt(
        60.0,
        "Seconds a request may take end to end before it gets 504 and its queued work is "
        "dropped. Shorter frees capacity sooner under overload.",
    )
    threads: int = opt(
        0,
        "CPU threads for the tower's intra-op pool (split over the ranks under --tp). 0 sizes it "
        "from what this process may really use: its affinity mask, capped by the cgroup CPU quota "
        "(cpu.max; a Kubernetes CPU limit) rounded down; torch's own default is every host core. "
        "More threads than that budget are preempted or throttled mid-forward, which stalls "
        "every other thread at the next barrier; fewer leave cores idle.",
    )
    preprocess_workers: int = opt(
        0,
        "Threads for decoding and preprocessing. They overlap the tower's forward; more than "
        "the free CPU cores only adds contention. 0: the CPU budget of --threads, at most 4.",
    )
    max_preprocess_items: int = opt(
        512,
        "Images being decoded and preprocessed at once, across requests; beyond it a request "
        "gets 429 before any decoding. Bounds the memory of requests not yet queued.",
    )
    pull_ttl: float = opt(
        300.0, "Seconds a pull-mode embedding stays retrievable at GET /v1/embeddings/{key}."
    )
    pull_store_mb: int = opt(
        1024, "Bound on host memory retained for pull mode; the oldest entries go first."
    )
    drain_timeout: float = opt(
        30.0, "On shutdown, seconds to finish in-flight requests before cancelling the rest."
    )
    sglang_encoder: bool = opt(
        False,
        "Also serve SGLang 0.5.23's encoder protocol (POST /encode, /scheduler_receive_url) so "
        "an SGLang prefill started with --language-only --encoder-urls takes its embeddings from "
        "this server over ZMQ (docs/integrations.md). SGLang sends no API key: serve it on the "
        "private network, without --api-key; /encode pushes to the host:port its caller names.",
    )

    def __post_init__(self) -> None:
        _positive(self, "request_timeout", "max_preprocess_items", "pull_ttl", "pull_store_mb", "max_body_mb")
        _non_negative(self, "drain_timeout", "threads", "preprocess_workers")  # 0: from the CPU budget
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.parallel.tp > 1:
            # Both modes build the fast tower on every rank (weights mode re-types its modules).
            if self.model.tower != "fast":
                raise ValueError(f"--tp {self.parallel.tp} needs --tower fast: the reference tower "
                                 "(transformers' module) cannot be sharded or replicated over ranks")
            if ":" in self.model.device:
                raise ValueError(f"--tp {self.parallel.tp} places rank r on cuda:r: use --device cuda "
                                 f"(or auto), not {self.model.device}")


# -- CLI generation: epd_encoder/flags.py (flags, environment variables, TOML keys) ----------
from epd_encoder.flags import add_arguments, from_namespace  # noqa: E402,F401  (stable import path)
