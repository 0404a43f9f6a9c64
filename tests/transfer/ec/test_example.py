# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from epd_encoder.transfer.ec.example import ExampleConnectorStore
from epd_encoder.transfer.ec.store import ec_rows
from epd_encoder.types import ItemOutput

KEY = "ab" * 32


def test_put_writes_vllm_example_connector_layout(tmp_path):
    store = ExampleConnectorStore(tmp_path)
    rows = torch.randn(6, 8)
    store.put(KEY, rows)
    path = tmp_path / KEY / "encoder_cache.safetensors"
    assert list(load_file(path)) == ["ec_cache"]
    assert torch.equal(load_file(path)["ec_cache"], rows)
    assert [p.name for p in (tmp_path / KEY).iterdir()] == ["encoder_cache.safetensors"]  # no temp left


def test_a_stored_key_is_left_as_it_is(tmp_path):
    store = ExampleConnectorStore(tmp_path)
    store.put(KEY, torch.zeros(2, 4))
    store.put(KEY, torch.ones(2, 4))
    assert torch.equal(load_file(store.path(KEY))["ec_cache"], torch.zeros(2, 4))


@pytest.mark.parametrize("key", ["../etc", "AB" * 32, "ab" * 31, ""])
def test_only_content_keys_name_files(tmp_path, key):
    with pytest.raises(ValueError, match="64-hex"):
        ExampleConnectorStore(tmp_path).put(key, torch.zeros(1, 1))


def test_ec_rows_concatenates_deepstack_on_the_hidden_axis_and_casts():
    emb, ds = torch.randn(4, 3), (torch.randn(4, 3), torch.randn(4, 3))
    rows = ec_rows(ItemOutput(emb, ds), "bfloat16")
    assert rows.dtype == torch.bfloat16 and rows.shape == (4, 9) and rows.is_contiguous()
    assert torch.equal(rows, torch.cat([emb, *ds], -1).to(torch.bfloat16))
    assert ec_rows(ItemOutput(emb)).dtype == torch.float32
