# SPDX-License-Identifier: Apache-2.0
"""Assemble the shared tier (L3) from ``--shared-cache*`` (config/shared_cache.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from epd_encoder.cache.shared import SharedTier
from epd_encoder.cache.shared_breaker import Breaker
from epd_encoder.cache.shared_client import GuardedStore
from epd_encoder.cache.shared_mooncake import MooncakeBackend
from epd_encoder.errors import ConfigError

if TYPE_CHECKING:
    from epd_encoder.config.shared_cache import SharedCacheConfig
    from epd_encoder.types import ItemOutput


def build_shared_tier(config: SharedCacheConfig,
                      to_device: Callable[[ItemOutput], ItemOutput] | None = None) -> SharedTier:
    """A tier not yet started (``start`` connects in the background). A missing Mooncake
    wheel fails here, at startup, not as endless misses."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--shared-cache needs the Mooncake wheel (mooncake-transfer-engine): {e}") from e
    breaker = Breaker(config.shared_cache_breaker_failures, config.shared_cache_breaker_cooldown)
    store = GuardedStore(lambda: MooncakeBackend.connect(config), breaker,
                         read_threads=config.shared_cache_read_threads,
                         retry_s=config.shared_cache_breaker_cooldown)
    return SharedTier(store, namespace=config.shared_cache_namespace,
                      read_deadline_s=config.shared_cache_deadline_ms / 1000.0,
                      write_deadline_s=config.shared_cache_put_deadline_ms / 1000.0,
                      write_queue=config.shared_cache_write_queue,
                      max_bytes=config.shared_cache_buffer_mb << 20, lease_s=config.shared_cache_lease_s,
                      to_device=to_device)
