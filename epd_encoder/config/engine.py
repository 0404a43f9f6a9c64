# SPDX-License-Identifier: Apache-2.0
"""The engine's sections: scheduler, cache, and the engine around them."""

from __future__ import annotations
from dataclasses import dataclass
from typing import Literal

from epd_encoder.config.base import MiB, opt, sub, _positive, _non_negative


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
