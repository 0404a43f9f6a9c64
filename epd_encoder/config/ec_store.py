# SPDX-License-Identifier: Apache-2.0
"""EC-store delivery (``delivery.mode = "ec_store"``): which of vLLM's connector stores the
server writes items into (docs/integrations.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from epd_encoder.config.base import opt


@dataclass(frozen=True)
class ECStoreConfig:
    ec_store_path: str | None = opt(
        None,
        "Directory shared with vLLM consumers run with ECExampleConnector "
        "(ec_connector_extra_config shared_storage_path): ec_store delivery writes "
        "<dir>/<key>/encoder_cache.safetensors. Unset: no file store.",
    )
    ec_store_mooncake: str | None = opt(
        None,
        "Mooncake master host:port whose Store holds vLLM's embedding objects "
        "(ECMooncakeConnector's cross-encoder cache); needs --ec-store-namespace. Unset: none.",
    )
    ec_store_namespace: str | None = opt(
        None,
        "vLLM's embedding namespace (build_embedding_namespace: model, revision, encoder hash, "
        "dtype, protocol); objects are keyed <namespace>@id:<key>.",
    )
    ec_store_metadata_server: str = opt(
        "P2PHANDSHAKE", "Mooncake metadata server for --ec-store-mooncake (P2PHANDSHAKE: none)."
    )
    ec_store_dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto",
        "dtype written to the EC store: the consumer's model dtype (vLLM runs fp32 checkpoints in "
        "bf16 on CPU unless told --dtype float32). auto keeps the tower's output dtype.",
    )

    def __post_init__(self) -> None:
        if self.ec_store_path is not None and self.ec_store_mooncake is not None:
            raise ValueError("give at most one of --ec-store-path and --ec-store-mooncake")
        if self.ec_store_mooncake is not None and not self.ec_store_namespace:
            raise ValueError("--ec-store-mooncake needs --ec-store-namespace (copy it from vLLM)")

    @property
    def enabled(self) -> bool:
        return self.ec_store_path is not None or self.ec_store_mooncake is not None
