# SPDX-License-Identifier: Apache-2.0
"""EC-store delivery: the server writes each item into the store of one of vLLM's own EC
connectors, under its content key, which the request then carries as its uuid (docs/integrations.md).

A store sees one tensor per item: the rows vLLM's encoder cache holds for it, the embedding
with any deepstack tensors concatenated along the hidden axis (what vLLM's Qwen3-VL
``embed_multimodal`` returns), cast to the consumer's dtype.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from epd_encoder.config.ec_store import ECStoreConfig
    from epd_encoder.types import ItemOutput

KEY_RE = re.compile(r"[0-9a-f]{64}")


class ECStore(Protocol):
    """Where a consumer's connector finds an item by its identifier (our content key)."""

    name: str

    def put(self, key: str, rows: torch.Tensor) -> None:
        """Store ``rows`` ([num_tokens, width], contiguous, on the host) under ``key``, visible
        to readers only once complete. A key already stored is left as it is (keys name content)."""
        ...

    def close(self) -> None: ...


def ec_rows(output: ItemOutput, dtype: str = "auto") -> torch.Tensor:
    """The item as vLLM's encoder cache holds it: ``[num_tokens, hidden * (1 + num_deepstack)]``."""
    import torch

    rows = output.joined()
    if dtype != "auto":
        rows = rows.to(getattr(torch, dtype))
    return rows.to("cpu").contiguous()


def check_key(key: str) -> str:
    if not KEY_RE.fullmatch(key):
        raise ValueError(f"an EC store key is a 64-hex content key, got {key[:80]!r}")
    return key


def open_store(config: ECStoreConfig) -> ECStore | None:
    """The store the config names, or None when EC-store delivery is off."""
    if config.ec_store_path is not None:
        from epd_encoder.transfer.ec.example import ExampleConnectorStore

        return ExampleConnectorStore(config.ec_store_path)
    if config.ec_store_mooncake is not None:
        from epd_encoder.transfer.ec.mooncake_store import MooncakeEmbeddingStore

        assert config.ec_store_namespace  # ECStoreConfig refuses --ec-store-mooncake without it
        return MooncakeEmbeddingStore.connect(config.ec_store_mooncake, config.ec_store_namespace,
                                              metadata_server=config.ec_store_metadata_server)
    return None
