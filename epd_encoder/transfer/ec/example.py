# SPDX-License-Identifier: Apache-2.0
"""vLLM ``ECExampleConnector``'s shared-filesystem layout (vLLM 0.32,
``distributed/ec_transfer/ec_connector/example_connector.py``):
``<shared_storage_path>/<identifier>/encoder_cache.safetensors`` holding one tensor, ``ec_cache``.

The consumer's scheduler tests the file's existence and its worker loads it in a later
step, so a file appears only complete: written beside it, then renamed into place.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from epd_encoder.transfer.ec.store import check_key

if TYPE_CHECKING:
    import torch

FILENAME = "encoder_cache.safetensors"
TENSOR = "ec_cache"


class ExampleConnectorStore:
    name = "example"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / check_key(key) / FILENAME

    def put(self, key: str, rows: torch.Tensor) -> None:
        from safetensors.torch import save_file

        path = self.path(key)
        if path.exists():
            return
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{FILENAME}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            save_file({TENSOR: rows.contiguous()}, str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def close(self) -> None:
        return None
