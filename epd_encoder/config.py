# SPDX-License-Identifier: Apache-2.0
"""One frozen config tree; the CLI is generated from it.

Each leaf field carries its help text (the trade-off it controls) in its
metadata; epd_encoder/flags.py turns every leaf into a flag, an environment
variable and a TOML key, and builds the frozen tree back (validation runs in
``__post_init__``, so a bad value fails before anything loads; messages name
the flag). Derived values are properties. Units are in the names: memory budgets
and the body cap are MiB (``_mb``), an encoded item's cap is bytes (``_bytes``), times
are seconds unless ``_ms``. The environment is read only in flags.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

MiB = 1 << 20


def opt(default: Any, help: str, **extra: Any) -> Any:
    """A config leaf: its default and the trade-off it controls."""
    return field(default=default, metadata={"help": help, **extra})


def sub(cls: type) -> Any:
    return field(default_factory=cls)


def _positive(obj: Any, *names: str, minimum: float = 0, strict: bool = True) -> None:
    """Refuse a leaf out of range, naming it as its flag (what the operator typed)."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum or (strict and value == minimum):
            raise ValueError(f"--{name.replace('_', '-')} must be {'>' if strict else '>='} {minimum:g}, "
                             f"got {value}")


def _non_negative(obj: Any, *names: str) -> None:
    _positive(obj, *names, strict=False)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_cost: int = opt(
        16384,
        "Pre-merge patch budget of one vision-tower forward. Larger batches raise "
        "images/s until the GPU saturates, but every item in a batch waits for the whole "
        "forward, so latency grows with it.",
    )
    max_batch_items: int = opt(
        64, "Item cap per forward; bounds per-batch bookkeeping and activation memory."
    )
    lookahead: int = opt(
        64,
        "At most this many items that do not fit are looked past per batch to fill the "
        "budget. More fills batches better (94% fill at 0, 99.6% at 64); each item passed "
        "over ages toward the starvation cap.",
    )
    max_skips: int = opt(
        8,
        "An item passed over this many times is never overtaken again: younger work ahead "
        "of it is bounded by max_skips x max_batch_cost. 0 is strict arrival order.",
    )
    max_wait_ms: float = opt(
        0.0,
        "Hold an under-full batch up to this long for more work (like Triton's "
        "max_queue_delay). 0 never waits: best latency, smaller batches under light load.",
    )
    attention_weight: float = opt(
        0.0,
        "Weight of the attention term (patches^2 per full-attention window) in an item's "
        "cost. 0 counts patches only; raise it for towers dominated by full attention.",
    )
    scheduling: Literal["lookahead", "reference"] = opt(
        "lookahead",
        "For comparisons only. 'lookahead' is this server's policy (arrival order, bounded "
        "look-ahead, starvation cap, in-flight coalescing). 'reference' is the policy common "
        "elsewhere, as a baseline: sort by id on every batch, no look-ahead, no coalescing "
        "(the cache still serves hits); it ignores lookahead, max_skips and max_wait_ms, and "
        "can starve an item.",
    )

    def __post_init__(self) -> None:
        _positive(self, "max_batch_cost", "max_batch_items")
        _non_negative(self, "lookahead", "max_skips", "max_wait_ms", "attention_weight")
        if self.scheduling not in ("lookahead", "reference"):
            raise ValueError(f"--scheduling must be 'lookahead' or 'reference', got {self.scheduling!r}")


@dataclass(frozen=True)
class CacheConfig:
    cache_mb: int = opt(
        1024,
        "Device-tier (L1) embedding cache size in MiB. Hits skip decode, preprocess and the "
        "tower; the memory comes out of what activations can use.",
    )
    host_cache_mb: int = opt(
        0,
        "Host-tier (L2) cache in MiB; L1 victims demote here and hits promote back. Costs "
        "host RAM and a host-to-device copy per hit. 0 disables the tier.",
    )
    admission: Literal["lru", "tinylfu"] = opt(
        "tinylfu",
        "Admission policy: 'tinylfu' keeps hot entries through one-off scans at the cost "
        "of refusing some first-time entries; 'lru' admits everything.",
    )

    def __post_init__(self) -> None:
        _non_negative(self, "cache_mb", "host_cache_mb")

    @property
    def l1_bytes(self) -> int:
        return self.cache_mb * MiB

    @property
    def l2_bytes(self) -> int:
        return self.host_cache_mb * MiB


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = sub(SchedulerConfig)
    cache: CacheConfig = sub(CacheConfig)
    max_pending_cost: int = opt(
        262144,
        "Bound on queued pre-merge patches; beyond it a request gets 429 Overloaded. Higher "
        "absorbs bursts but holds more preprocessed pixels in memory and adds queueing delay.",
    )

    def __post_init__(self) -> None:
        _positive(self, "max_pending_cost")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = opt(
        None,
        "Checkpoint: a local directory, or a Hugging Face Hub id (org/name) resolved through "
        "the Hub cache (HF_HUB_OFFLINE=1: cache only). From the Hub only config.json, the "
        "processor configs, the safetensors index and the shards holding vision tensors are "
        "downloaded (a 7B VLM costs its 1-2 GB vision shards, not 16 GB); a single-file "
        "model.safetensors is downloaded whole. Without it the built-in tiny model is served.",
    )
    revision: str | None = opt(
        None, "Hub revision (branch, tag or commit) of a Hub --model; default: main. Not "
        "allowed with a local directory.",
    )
    model_id: str | None = opt(
        None, "Name reported in responses; default: the directory name or the Hub id. Not part "
        "of content keys (those hash the configs and vision weights, see docs/models.md).",
    )
    device: str = opt(
        "auto", "Device for the tower: 'auto' picks cuda when present, else cpu; 'cuda' or "
        "'cuda:N' fail at start-up when that GPU is absent.", metavar="{auto,cpu,cuda,cuda:N}",
    )
    tower: Literal["fast", "reference"] = opt(
        "fast",
        "Vision forward: 'fast' is our packed implementation (equal to transformers within "
        "~1e-7); 'reference' runs transformers' own module, slower, and bitwise equal to it "
        "for an item encoded alone (a packed batch moves the last bits; see --batch-invariant).",
    )
    batch_invariant: bool = opt(
        False,
        "Encode each image/video/tile alone within a batch, so its embedding is bitwise the "
        "same whatever it is batched with, cache hits included (at a fixed thread count). "
        "With --tower reference, a prefill reproduces the aggregated model's logits exactly "
        "when that model runs under epd_encoder.models.invariant.batch_invariant. Costs the "
        "packing gain: about 1.1x the forward time on CPU, more on GPU for small images.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "Tower dtype: 'auto' is bfloat16 on CUDA and float32 on CPU."
    )
    preprocess_backend: Literal["torchvision", "pil"] = opt(
        "torchvision",
        "Which transformers image-processor backend the pixels equal bit for bit: "
        "'torchvision' is what transformers picks wherever torchvision is installed (every "
        "vLLM/SGLang deployment); 'pil' is its fallback without it. They resize differently "
        "(pixel_values differ by up to ~0.3), so pick the one the aggregated setup you "
        "compare with runs. Part of the content key. Neither imports torchvision.",
    )

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.revision is not None and self.model is None:
            raise ValueError("--revision needs --model (a Hub id)")


@dataclass(frozen=True)
class LimitsConfig:
    max_items: int = opt(
        64, "Most images per request (413 beyond). Bounds one request's share of the queue."
    )
    max_image_bytes: int = opt(
        32 * MiB, "Largest encoded image accepted, in bytes (413 beyond), checked before decoding."
    )
    max_image_pixels: int = opt(
        50_000_000,
        "Largest declared width x height (413 beyond), read from the header before decoding: "
        "the decompression-bomb guard.",
    )
    max_aspect_ratio: float = opt(
        200.0, "Largest long/short side ratio (400 beyond); Qwen's smart_resize allows 200."
    )
    min_pixels_floor: int | None = opt(
        None, "Lowest per-request min_pixels override allowed; default: the checkpoint's own."
    )
    max_pixels_ceiling: int | None = opt(
        None, "Highest per-request max_pixels override allowed; default: the checkpoint's own."
    )
    max_decoded_mb: int = opt(
        1024,
        "Host MiB that images being decoded and staged may hold at once, across requests, "
        "predicted from each header before decoding (about 12 bytes per source pixel with the "
        "torchvision backend, 5 with pil). Beyond it items wait their turn, in arrival order, "
        "within the request timeout; one image bigger than the whole budget runs alone. Lower "
        "bounds peak RSS; too low serializes decoding of large images.",
    )

    def __post_init__(self) -> None:
        _positive(self, "max_items", "max_image_bytes", "max_image_pixels", "max_aspect_ratio",
                  "max_decoded_mb")


@dataclass(frozen=True)
class VideoConfig:
    """Video input: bounds checked on the container header, and again while decoding."""

    max_video_bytes: int = opt(
        64 * MiB, "Largest encoded video accepted, in bytes (413 beyond). The body limit "
        "(--max-body-mb) also applies, to the base64 text.",
    )
    max_video_seconds: float = opt(
        1800.0, "Longest video accepted, in seconds of declared or decoded duration (413 beyond).",
    )
    max_video_frame_pixels: int = opt(
        3840 * 2160, "Largest frame, width x height (413 beyond): 4K UHD by default.",
    )
    max_video_decoded_frames: int = opt(
        54_000, "Most frames a video may declare or decode (413 beyond): 30 minutes at 30 fps.",
    )
    max_video_decoded_pixels: int = opt(
        9000 * 1920 * 1080,
        "Most pixels the decoder may produce for one video, up to the last sampled frame "
        "(413 beyond; 5 minutes of 1080p at 30 fps). Checked on the header before decoding, "
        "so a tiny file declaring hours of 8K frames is refused without decoding.",
    )
    max_video_sampled_frames: int = opt(
        768, "Most frames sampled from one video (a request's max_frames may not exceed it).",
    )

    def __post_init__(self) -> None:
        _positive(self, "max_video_bytes", "max_video_seconds", "max_video_frame_pixels",
                  "max_video_decoded_frames", "max_video_decoded_pixels", "max_video_sampled_frames")


@dataclass(frozen=True)
class FetchConfig:
    allow_url_fetch: bool = opt(
        False,
        "Allow http(s) image URLs. Off by default: fetching for clients is an SSRF surface. "
        "When on, private, loopback, link-local and metadata addresses stay blocked.",
    )
    fetch_timeout: float = opt(10.0, "Total seconds allowed for one URL fetch, redirects included.")
    fetch_max_redirects: int = opt(3, "Redirect hops followed; each hop is re-checked.")

    def __post_init__(self) -> None:
        _positive(self, "fetch_timeout")
        _non_negative(self, "fetch_max_redirects")


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
        _positive(self, "header_timeout", "body_timeout", "keep_alive_timeout")
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

    def __post_init__(self) -> None:
        _positive(self, "bootstrap_timeout", "transfer_timeout", "room_record_ttl", "max_rooms_per_peer")

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
        "(gloo on loopback; on CUDA rank r uses cuda:r), each with cores/N intra-op threads. Rank "
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
        "Seconds between rank 0's liveness checks of the ranks, and between idle heartbeats "
        "(one small broadcast, sent only when no batch went out). Must be under half of "
        "--tp-timeout.",
    )

    def __post_init__(self) -> None:
        _positive(self, "tp", minimum=1, strict=False)
        _positive(self, "tp_timeout", "tp_heartbeat")
        if self.tp_heartbeat >= self.tp_timeout / 2:
            raise ValueError(f"--tp-heartbeat ({self.tp_heartbeat:g}) must be under half of --tp-timeout "
                             f"({self.tp_timeout:g}), or an idle rank would time out")


@dataclass(frozen=True)
class ServeConfig:
    model: ModelConfig = sub(ModelConfig)
    engine: EngineConfig = sub(EngineConfig)
    limits: LimitsConfig = sub(LimitsConfig)
    video: VideoConfig = sub(VideoConfig)
    fetch: FetchConfig = sub(FetchConfig)
    auth: AuthConfig = sub(AuthConfig)
    push: PushConfig = sub(PushConfig)
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
    preprocess_workers: int = opt(
        4,
        "Threads for decoding and preprocessing. They overlap the tower's forward; more than "
        "the free CPU cores only adds contention.",
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

    def __post_init__(self) -> None:
        _positive(self, "request_timeout", "preprocess_workers", "max_preprocess_items", "pull_ttl",
                  "pull_store_mb", "max_body_mb")
        _non_negative(self, "drain_timeout")
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
