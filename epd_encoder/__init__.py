# SPDX-License-Identifier: Apache-2.0
"""epd-encoder: the encode tier for EPD-disaggregated VLM serving.

Public names are imported lazily so that ``import epd_encoder`` stays cheap
(no torch import for users of the pure-bookkeeping parts, nor for the HTTP
clients until a response's tensors are unpacked).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "EncodeScheduler": "epd_encoder.engine.scheduler",
    "PendingEncodeItem": "epd_encoder.engine.scheduler",
    "EmbeddingCache": "epd_encoder.cache.lru",
    "TieredEmbeddingCache": "epd_encoder.cache.tiered",
    "InflightTable": "epd_encoder.engine.coalescer",
    "EncodeWorker": "epd_encoder.engine.worker",
    "EncodeRequest": "epd_encoder.engine.worker",
    "WorkItem": "epd_encoder.engine.worker",
    "ItemOutput": "epd_encoder.types",
    "content_key": "epd_encoder.preprocess.keys",
    "EncodeClient": "epd_encoder.client",
    "AsyncEncodeClient": "epd_encoder.client",
    "EncodedItem": "epd_encoder.client",
    "EncodeResult": "epd_encoder.client",
    "image_item": "epd_encoder.client",
    "video_item": "epd_encoder.client",
    "EmbeddingReceiver": "epd_encoder.receiver",
    "ReceivedItem": "epd_encoder.receiver",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'epd_encoder' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
