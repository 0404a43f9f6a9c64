# SPDX-License-Identifier: Apache-2.0
"""The shared tier's entry format: vLLM's object byte for byte, plus a checked sidecar."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from blake3 import blake3

from epd_encoder.cache.shared_format import (
    CorruptEntry,
    EntryMeta,
    decode_meta,
    decode_value,
    encode_entry,
    meta_key,
    value_key,
)
from epd_encoder.transfer.ec.mooncake_store import HEADER, MAGIC, encode_object
from epd_encoder.types import ItemOutput

KEY = "ab" * 32
GRID = (1, 4, 6)


def _output(dtype=torch.bfloat16, deepstack=2) -> ItemOutput:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(6, 8, generator=g).to(dtype)
    ds = tuple(torch.randn(6, 8, generator=g).to(dtype) for _ in range(deepstack)) or None
    return ItemOutput(emb, ds)


def _entry(out: ItemOutput, grid=GRID, modality="image", video=None) -> tuple[bytes, bytes]:
    e = encode_entry(KEY, out, grid_thw=grid, modality=modality, video=video)
    return e.header + bytes(e.body), e.meta


def _decode(value: bytes, meta: bytes, grid=GRID, tokens=6) -> ItemOutput:
    return decode_value(decode_meta(KEY, meta), torch.frombuffer(bytearray(value), dtype=torch.uint8),
                        grid_thw=grid, num_tokens=tokens)


def _same(a: ItemOutput, b: ItemOutput) -> bool:
    return torch.equal(a.embedding, b.embedding) and len(a.deepstack or ()) == len(b.deepstack or ()) and all(
        torch.equal(x, y) for x, y in zip(a.deepstack or (), b.deepstack or ()))


def test_keys_are_vllms_and_the_sidecar_cannot_collide_with_them():
    assert value_key("ns", KEY) == f"ns@id:{KEY}"
    assert meta_key("ns", KEY) == f"ns@epd-meta:v1@id:{KEY}"
    assert not meta_key("ns", KEY).startswith("ns@id:")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("deepstack", [0, 3])
def test_an_entry_round_trips_exactly(dtype, deepstack):
    out = _output(dtype, deepstack)
    value, meta = _entry(out)
    assert _same(_decode(value, meta), out)


def test_the_object_is_exactly_what_vllms_reader_takes():
    out = _output(deepstack=2)
    value, _ = _entry(out)
    assert value == encode_object(out.joined())  # the header + rows vLLM's batch_get_into expects
    assert HEADER.unpack(value[:HEADER.size]) == (MAGIC, 12, 6, 24)


def test_the_sidecar_carries_grid_split_and_video_timing():
    video = {"frames_indices": [0, 2], "fps": 2.0, "second_per_grid_ts": 1.0}
    _, raw = _entry(_output(), (2, 4, 6), "video", video)
    meta = decode_meta(KEY, raw)
    assert (meta.grid_thw, meta.num_deepstack, meta.hidden_size, meta.video) == ((2, 4, 6), 2, 8, video)


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 1
    return bytes(b)


@pytest.mark.parametrize("at", [0, 5, HEADER.size + 3, -1])
def test_any_flipped_bit_is_caught(at):
    value, meta = _entry(_output())
    with pytest.raises(CorruptEntry):
        _decode(_flip(value, at), meta)


def test_a_truncated_or_extended_object_is_caught():
    value, meta = _entry(_output())
    for bad in (value[:-2], value + b"\0\0"):
        with pytest.raises(CorruptEntry, match="bytes"):
            _decode(bad, meta)


def test_a_header_that_disagrees_is_caught_even_under_a_matching_checksum():
    value, raw = _entry(_output())
    forged = HEADER.pack(MAGIC, 12, 12, 12) + value[HEADER.size:]  # same length, other shape
    meta = msgspec.structs.replace(decode_meta(KEY, raw), blake3=blake3(forged).hexdigest())
    with pytest.raises(CorruptEntry, match="header"):
        _decode(forged, msgspec.json.encode(meta))


@pytest.mark.parametrize("change", [dict(v=2), dict(key="cd" * 32), dict(nbytes=10), dict(dtype="int8"),
                                    dict(num_tokens=0)])
def test_a_sidecar_that_does_not_fit_is_caught(change):
    _, raw = _entry(_output())
    bad = msgspec.json.encode(msgspec.structs.replace(msgspec.json.decode(raw, type=EntryMeta), **change))
    with pytest.raises(CorruptEntry):
        decode_meta(KEY, bad)


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'{"v": 1}'])
def test_an_unreadable_sidecar_is_caught(raw):
    with pytest.raises(CorruptEntry):
        decode_meta(KEY, raw)


def test_an_entry_for_another_grid_is_not_served():
    value, meta = _entry(_output())
    with pytest.raises(CorruptEntry):
        _decode(value, meta, grid=(1, 2, 12))
    with pytest.raises(CorruptEntry):
        _decode(value, meta, tokens=5)


def test_the_rows_are_written_from_a_view_not_a_copy():
    # A copy of a 32 MiB item held the GIL ~40 ms (tobytes, then the concatenation) on the writer thread.
    out = _output(torch.float32, deepstack=0)
    e = encode_entry(KEY, out, grid_thw=GRID, modality="image", video=None)
    assert isinstance(e.body, memoryview) and np.frombuffer(e.body, np.uint8).ctypes.data == out.embedding.data_ptr()
    assert e.nbytes == len(e.header) + out.embedding.numel() * 4
