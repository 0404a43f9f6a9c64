# SPDX-License-Identifier: Apache-2.0
"""Our objects in vLLM's Mooncake embedding store: the codec against a fake client, and a real
store (``mooncake_master`` on loopback) when the Mooncake wheel is installed. The bytes are
checked against vLLM's own codec in tests/integrations/test_vllm_ec_mooncake.py."""

from __future__ import annotations

import struct

import pytest
import torch

from epd_encoder.transfer.ec.mooncake_store import HEADER, MAGIC, MooncakeEmbeddingStore, embedding_key, encode_object
from tests.mooncake_master import mooncake_master  # noqa: F401  (fixture; also imported from here by others)

KEY = "cd" * 32


def test_object_is_header_then_rows():
    rows = torch.randn(5, 7)
    obj = encode_object(rows)
    assert struct.unpack("<IIQQ", obj[:24]) == (0x4D4F4F4E, 0, 5, 7)
    assert torch.equal(torch.frombuffer(bytearray(obj[24:]), dtype=torch.float32).view(5, 7), rows)
    assert HEADER.unpack(encode_object(rows.to(torch.bfloat16))[:24])[1] == 12


@pytest.mark.parametrize("rows", [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, 4)])
def test_objects_vllm_cannot_read_are_refused(rows):
    with pytest.raises(ValueError):
        encode_object(rows)


class FakeClient:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def is_exist(self, key: str) -> int:
        return int(key in self.objects)

    def put(self, key: str, value) -> int:
        self.objects[key] = bytes(value)
        return 0

    def close(self) -> int:
        return 0


def test_put_keys_by_namespace_and_skips_present_objects():
    client = FakeClient()
    store = MooncakeEmbeddingStore(client, "ns")
    store.put(KEY, torch.zeros(2, 2))
    store.put(KEY, torch.ones(2, 2))
    assert list(client.objects) == [f"ns@id:{KEY}"] == [embedding_key("ns", KEY)]
    assert client.objects[f"ns@id:{KEY}"][24:] == bytes(16)


def test_real_store_holds_the_object_under_vllms_key(mooncake_master):
    master, metadata = mooncake_master
    store = MooncakeEmbeddingStore.connect(master, "ns", metadata_server=metadata, segment_bytes=64 << 20,
                                           buffer_bytes=16 << 20)
    try:
        rows = torch.randn(6, 128)
        store.put(KEY, rows)
        got = store.client.get(embedding_key("ns", KEY))
        assert bytes(got) == encode_object(rows)
    finally:
        store.close()
