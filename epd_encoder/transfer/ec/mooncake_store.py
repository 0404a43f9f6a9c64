# SPDX-License-Identifier: Apache-2.0
"""Objects of vLLM's Mooncake embedding store (vLLM 0.32,
``ec_connector/mooncake_store_embedding/``): key ``<namespace>@id:<identifier>``, value a
``<IIQQ`` header (magic, dtype code, tokens, width) followed by the 2-D tensor's bytes.

vLLM's ``ECMooncakeConnector`` producer resolves items from this store before encoding
(``MooncakeEmbeddingStoreBackend.resolve_inputs``), so an item we put is one its encoder
skips. The namespace is the consumer's ``build_embedding_namespace(vllm_config)``: it hashes
vLLM's multimodal config, so the operator copies it from vLLM rather than us deriving it.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, Protocol

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.transfer.ec.store import check_key

if TYPE_CHECKING:
    import torch

MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IIQQ")
DTYPE_CODES = {"float32": 0, "float16": 11, "bfloat16": 12}  # vLLM's _TORCH_DTYPE_TO_MOONCAKE_DTYPE


def embedding_key(namespace: str, key: str) -> str:
    return f"{namespace}@id:{check_key(key)}"


def encode_object(rows: torch.Tensor) -> bytes:
    """Header and bytes of one item, as vLLM's ``put_tensor`` writes it."""
    dtype = str(rows.dtype).removeprefix("torch.")
    if dtype not in DTYPE_CODES:
        raise ValueError(f"vLLM's Mooncake embedding store takes {sorted(DTYPE_CODES)}, not {dtype}")
    if rows.dim() != 2:
        raise ValueError(f"an embedding object is 2-D, got {tuple(rows.shape)}")
    import torch

    body = rows.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return HEADER.pack(MAGIC, DTYPE_CODES[dtype], *rows.shape) + body


class StoreClient(Protocol):
    """The slice of ``mooncake.store.MooncakeDistributedStore`` this writer uses."""

    def is_exist(self, key: str) -> int: ...
    def put(self, key: str, value: Any) -> int: ...
    def close(self) -> int: ...


class MooncakeEmbeddingStore:
    name = "mooncake"

    def __init__(self, client: StoreClient, namespace: str) -> None:
        self.client, self.namespace = client, namespace

    @classmethod
    def connect(cls, master: str, namespace: str, *, metadata_server: str = "P2PHANDSHAKE",
                hostname: str = "127.0.0.1", segment_bytes: int = 512 << 20,
                buffer_bytes: int = 128 << 20) -> MooncakeEmbeddingStore:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConfigError(f"--ec-store-mooncake needs mooncake-transfer-engine ({e})") from e
        store = MooncakeDistributedStore()
        rc = store.setup(hostname, metadata_server, segment_bytes, buffer_bytes, "tcp", "", master)
        if rc != 0:
            raise ConfigError(f"Mooncake Store setup against master {master} returned {rc}")
        return cls(store, namespace)

    def put(self, key: str, rows: torch.Tensor) -> None:
        name = embedding_key(self.namespace, key)
        if self.client.is_exist(name) == 1:
            return
        rc = self.client.put(name, encode_object(rows))
        if rc != 0 and self.client.is_exist(name) != 1:  # a racing writer's identical object is fine
            raise EncodeFailed(f"Mooncake Store put of {name[-80:]} returned {rc}")

    def close(self) -> None:
        self.client.close()
