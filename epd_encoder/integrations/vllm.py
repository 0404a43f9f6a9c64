# SPDX-License-Identifier: Apache-2.0
"""A vLLM EC connector that pulls each item's encoder output from the encode tier by key.

Load it in vLLM (0.32) with::

    --ec-transfer-config '{"ec_connector": "EPDEncoderConnector",
      "ec_connector_module_path": "epd_encoder.integrations.vllm", "ec_role": "ec_consumer",
      "ec_connector_extra_config": {"encoder_url": "http://encoder:8000"}}'

and send each item with its content key (from an ``ec_store`` or ``pull`` answer) as the
item's uuid. Only vLLM imports this module; it needs nothing beyond vLLM's own
environment (stdlib, torch and the package's wire format).

The scheduler-side connector fetches ``GET /v1/embeddings/{key}`` on a thread pool as soon
as it sees the request (``ensure_cache_available`` defers the request until the bytes are
in hand), then ships the tensor to the workers inside the step's connector metadata. A
failure is known before the request is scheduled, never in the middle of a forward:

* ``on_missing: "error"`` (default): the request ends with an error (vLLM's
  ``take_unavailable_requests``); the log names the key and why (tier down, timeout, 404);
* ``on_missing: "local"``: vLLM encodes the item itself, which needs the true vision tower.

A request whose items carry no uuid has vLLM's own hash as identifier, which the tier does
not know: under ``"error"`` it fails, so a consumer that also takes raw media uses ``"local"``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from epd_encoder.integrations.pull import UnavailableItem, fetch_rows

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
__all__ = ["EPDEncoderConnector", "EPDConnectorMetadata"]


@dataclass
class EPDConnectorMetadata(ECConnectorMetadata):
    """One step's loads: identifier -> rows, already in the model's dtype, on the host."""

    items: dict[str, torch.Tensor] = field(default_factory=dict)


class EPDEncoderConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        assert ec is not None  # the base class refuses a config without it
        url = ec.get_from_extra_config("encoder_url", None)
        if not url:
            raise ValueError("EPDEncoderConnector needs ec_connector_extra_config.encoder_url")
        self._url = str(url)
        self._timeout = float(ec.get_from_extra_config("timeout", 30.0))
        self._api_key = ec.get_from_extra_config("api_key", None)
        self._on_missing = str(ec.get_from_extra_config("on_missing", "error"))
        if self._on_missing not in ("error", "local"):
            raise ValueError(f"on_missing must be 'error' or 'local', got {self._on_missing!r}")
        if self.is_producer:
            raise ValueError("EPDEncoderConnector is consumer-only: the encode tier is the producer")
        model = vllm_config.model_config
        dtype = model.dtype
        self._dtype: torch.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
        deepstack = getattr(getattr(model.hf_config, "vision_config", None), "deepstack_visual_indexes", None)
        self._width = model.get_hidden_size() * (1 + len(deepstack or ()))
        # Scheduler side. A fetch lives from the first sight of its key until it is handed to
        # the workers or every request that wanted it is gone.
        self._fetches: dict[str, Future[torch.Tensor]] = {}
        self._wanted_by: dict[str, set[str]] = {}
        self._local: set[str] = set()  # identifiers in vLLM's encoder cache (alloc..free)
        self._to_load: dict[str, torch.Tensor] = {}
        self._unavailable: set[str] = set()
        self._pool = (ThreadPoolExecutor(int(ec.get_from_extra_config("fetch_threads", 4)),
                                         thread_name_prefix="epd-ec-fetch")
                      if role == ECConnectorRole.SCHEDULER else None)

    # -- scheduler side --------------------------------------------------------------------

    def _fetch(self, key: str, num_embeds: int) -> torch.Tensor:
        rows = fetch_rows(self._url, key, timeout=self._timeout, api_key=self._api_key)
        if tuple(rows.shape) != (num_embeds, self._width):
            raise UnavailableItem(f"key {key}: the encode tier's output is {tuple(rows.shape)}, this "
                                  f"model needs {(num_embeds, self._width)} (another model or processor?)")
        return rows.to(self._dtype).contiguous()

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        assert self._pool is not None
        ready = True
        for index, feature in enumerate(request.mm_features):
            if feature.mm_position.offset + feature.mm_position.length <= num_computed_tokens:
                continue
            key = feature.identifier
            if key in self._local:
                continue
            fut = self._fetches.get(key)
            if fut is None:
                fut = self._pool.submit(self._fetch, key, request.get_num_encoder_embeds(index))
                self._fetches[key] = fut
            self._wanted_by.setdefault(key, set()).add(request.request_id)
            if not fut.done():
                ready = False
            elif fut.exception() is not None and self._on_missing == "error":
                if request.request_id not in self._unavailable:
                    log.warning("request %s fails: %s", request.request_id, fut.exception())
                self._unavailable.add(request.request_id)
                ready = False
        return ready

    def has_cache_item(self, identifier: str) -> bool:
        fut = self._fetches.get(identifier)
        return fut is not None and fut.done() and fut.exception() is None

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        key = request.mm_features[index].identifier
        self._local.add(key)
        fut = self._fetches.pop(key, None)
        self._wanted_by.pop(key, None)
        if fut is None or not fut.done():
            return
        if fut.exception() is None:
            self._to_load[key] = fut.result()
        else:  # on_missing "local": vLLM encodes this item itself
            log.warning("encoding %s locally: %s", key, fut.exception())

    def update_state_after_free(self, request: Request, index: int) -> None:
        self._local.discard(request.mm_features[index].identifier)

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = EPDConnectorMetadata(items=self._to_load)
        self._to_load = {}
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        for feature in request.mm_features:
            waiting = self._wanted_by.get(feature.identifier)
            if waiting is None:
                continue
            waiting.discard(request.request_id)
            if not waiting:  # nobody left for this fetch: drop it (a failure is retried next time)
                del self._wanted_by[feature.identifier]
                fut = self._fetches.pop(feature.identifier, None)
                if fut is not None:
                    fut.cancel()
        self._unavailable.discard(request.request_id)
        return False, None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- worker side -----------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        from vllm.platforms import current_platform

        meta = self._get_connector_metadata()
        assert isinstance(meta, EPDConnectorMetadata)
        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        for key, rows in meta.items.items():
            if key not in encoder_cache:
                encoder_cache[key] = rows.to(device)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return None  # consumer-only
