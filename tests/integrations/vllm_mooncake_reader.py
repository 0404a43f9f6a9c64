# SPDX-License-Identifier: Apache-2.0
"""Read our Mooncake objects with vLLM's own embedding-store code (run in the vLLM venv).

``python vllm_mooncake_reader.py SPEC.json OUT.safetensors``. SPEC: ``namespace``, ``objects``
(store key -> file holding the object's bytes as the real store returned them) and ``items``
(identifier -> ``{"shape", "dtype"}``). vLLM's ``MooncakeEmbeddingStoreBackend.resolve_inputs``
runs over a dict-backed stand-in for the Mooncake binding (exists, register, batch_get_into by
address), so vLLM's key, header check and copy are what decode our bytes. OUT holds what vLLM
put into its encoder cache.
"""

from __future__ import annotations

import ctypes
import json
import math
import sys
from pathlib import Path


class BytesStore:
    """The four calls vLLM's MooncakeEmbeddingStoreClient makes to read, served from bytes."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    def batch_is_exist(self, keys):
        return [1 if k in self.objects else 0 for k in keys]

    def register_buffer(self, addr, size):
        return 0

    def unregister_buffer(self, addr):
        return 0

    def batch_get_into(self, keys, addrs, sizes):
        out = []
        for k, a, s in zip(keys, addrs, sizes):
            data = self.objects[k]
            if len(data) > s:
                out.append(-600)
                continue
            ctypes.memmove(a, data, len(data))
            out.append(len(data))
        return out

    def close(self):
        return 0


def main(spec_path: str, out_path: str) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.backend import (
        MooncakeEmbeddingStoreBackend,
    )
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import TensorSpec
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client import (
        MooncakeEmbeddingStoreClient,
    )

    spec = json.loads(Path(spec_path).read_text())
    objects = {k: Path(f).read_bytes() for k, f in spec["objects"].items()}
    client = MooncakeEmbeddingStoreClient(BytesStore(objects), read_buffer_bytes=64 << 20)
    backend = MooncakeEmbeddingStoreBackend(client, spec["namespace"], max_pending_items=4,
                                            max_pending_bytes=1 << 20)
    expected = {}
    for ident, item in spec["items"].items():
        dtype = getattr(torch, item["dtype"])
        shape = tuple(item["shape"])
        expected[ident] = TensorSpec(shape, str(dtype), math.prod(shape) * dtype.itemsize)
    cache: dict = {}
    loaded = backend.resolve_inputs(expected, cache, "cpu")
    save_file({k: v.contiguous() for k, v in cache.items()}, out_path,
              metadata={"loaded": json.dumps(sorted(loaded))})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
