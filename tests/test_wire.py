# SPDX-License-Identifier: Apache-2.0
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from epd_encoder.errors import EncodeFailed, SchemaError
from epd_encoder.types import ItemOutput
from epd_encoder.wire import (
    FORMAT,
    ItemMeta,
    pack_inline,
    pack_item,
    unpack_inline,
    unpack_item,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def key(i: int) -> str:
    return f"{i:064x}"


def make(i=0, tokens=3, hidden=4, dtype="float32", n_ds=0, cache="miss", seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + i)
    rand = lambda: torch.randn(tokens, hidden, generator=g).to(DTYPES[dtype])
    out = ItemOutput(rand(), tuple(rand() for _ in range(n_ds)) if n_ds else None)
    return ItemMeta.describe(out, key=key(i), grid_thw=(1, 2, 2 * tokens), cache=cache), out


def same_output(a: ItemOutput, b: ItemOutput) -> bool:
    if not torch.equal(a.embedding, b.embedding) or a.embedding.dtype != b.embedding.dtype:
        return False
    if (a.deepstack is None) != (b.deepstack is None):
        return False
    return all(torch.equal(x, y) for x, y in zip(a.deepstack or (), b.deepstack or ())) and len(
        a.deepstack or ()
    ) == len(b.deepstack or ())


def header_of(body: bytes) -> dict:
    (n,) = struct.unpack_from("<Q", body, 0)
    return json.loads(body[8 : 8 + n])


def rewrite_metadata(body: bytes, **changes) -> bytes:
    """The same tensors, re-saved by the reference writer with edited metadata."""
    meta = dict(header_of(body)["__metadata__"])
    meta.update(changes)
    return st_save(st_load(body), {k: v for k, v in meta.items() if v is not None})


item_spec = st.tuples(
    st.integers(1, 12), st.integers(1, 12), st.sampled_from(list(DTYPES)), st.integers(0, 3),
    st.sampled_from(["hit", "miss", "coalesced"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(item_spec, min_size=0, max_size=6), rid=st.text(max_size=20), model=st.text(max_size=20))
def test_inline_round_trip(specs, rid, model):
    items = [make(i, t, h, d, n, c) for i, (t, h, d, n, c) in enumerate(specs)]
    info, back = unpack_inline(pack_inline(items, model=model, request_id=rid))
    assert info == {"model": model, "request_id": rid}
    assert [m for m, _ in back] == [m for m, _ in items]
    assert all(same_output(a, b) for (_, a), (_, b) in zip(items, back))


@settings(max_examples=30, deadline=None)
@given(spec=item_spec)
def test_item_round_trip(spec):
    t, h, d, n, c = spec
    meta, out = make(7, t, h, d, n, c)
    model, meta2, out2 = unpack_item(pack_item(meta, out, model="m/x"))
    assert (model, meta2) == ("m/x", meta)
    assert same_output(out, out2)


def test_body_is_a_standard_safetensors_file(tmp_path):
    items = [make(0, n_ds=2, dtype="bfloat16"), make(1, dtype="bfloat16")]
    body = pack_inline(items, model="org/model", request_id="req-1")
    path = tmp_path / "body.safetensors"
    path.write_bytes(body)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        names = set(f.keys())
        emb1 = f.get_tensor("item.1.embedding")
    assert names == {"item.0.embedding", "item.0.deepstack.0", "item.0.deepstack.1", "item.1.embedding"}
    assert meta["format"] == FORMAT and meta["model"] == "org/model" and meta["request_id"] == "req-1"
    assert json.loads(meta["items"]) == [m.to_json() for m, _ in items]
    assert torch.equal(emb1, items[1][1].embedding)
    assert (8 + struct.unpack_from("<Q", body)[0]) % 8 == 0  # tensor data starts 8-byte aligned


def test_reference_writer_bodies_are_accepted():
    meta, out = make(0, n_ds=1, dtype="float16")
    body = st_save(
        {"item.0.embedding": out.embedding, "item.0.deepstack.0": out.deepstack[0]},
        {"format": FORMAT, "model": "m", "request_id": "r", "items": json.dumps([meta.to_json()])},
    )
    _, [(meta2, out2)] = unpack_inline(body)
    assert meta2 == meta and same_output(out, out2)


def test_many_items_and_repeated_and_strided_tensors():
    items = [make(i, tokens=2, hidden=3) for i in range(300)]
    shared = items[0]
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    strided = ItemOutput(base.t()[:, :3], (base.t()[:, 1:],))  # non-contiguous views of one storage
    grad = ItemOutput(torch.ones(2, 3, requires_grad=True))
    extra = [
        shared,
        (ItemMeta.describe(strided, key=key(9), grid_thw=(1, 2, 12), cache="hit"), strided),
        (ItemMeta.describe(grad, key=key(8), grid_thw=(1, 2, 4), cache="miss"), grad),
    ]
    _, back = unpack_inline(pack_inline(items + extra, model="m", request_id="r"))
    assert len(back) == 303
    assert all(same_output(a, b) for (_, a), (_, b) in zip(items + extra, back))


def test_unpacked_tensors_are_writable_and_independent_of_the_body():
    meta, out = make(0)
    body = pack_item(meta, out, model="m")
    _, _, got = unpack_item(body)
    got.embedding.add_(1.0)
    _, _, again = unpack_item(body)
    assert torch.equal(again.embedding, out.embedding)


def test_item_meta_json_round_trip_ignores_extra_keys():
    meta, _ = make(3, n_ds=2)
    d = meta.to_json()
    assert json.loads(json.dumps(d)) == d and d["grid_thw"] == [1, 2, 6]
    assert ItemMeta.from_json({**d, "url": "/v1/embeddings/x"}) == meta


@pytest.mark.parametrize(
    "change",
    [
        {"key": "A" * 64}, {"key": "a" * 63}, {"key": 5}, {"num_tokens": 0}, {"num_tokens": True},
        {"num_tokens": 2.0}, {"hidden_size": "8"}, {"grid_thw": [1, 2]}, {"grid_thw": [1, 0, 2]},
        {"grid_thw": "123"}, {"cache": "maybe"}, {"dtype": "float64"}, {"num_deepstack": -1},
    ],
)
def test_item_meta_rejects_bad_fields(change):
    d = make(0)[0].to_json()
    with pytest.raises(SchemaError):
        ItemMeta.from_json({**d, **change})


@pytest.mark.parametrize("bad", [None, [], "x", {"key": key(0)}])
def test_item_meta_rejects_non_objects_and_missing_fields(bad):
    with pytest.raises(SchemaError):
        ItemMeta.from_json(bad)


def test_pack_rejects_meta_that_disagrees_with_tensors():
    meta, out = make(0, tokens=3, hidden=4, n_ds=1)
    d = meta.to_json()
    for change in ({"num_tokens": 4}, {"hidden_size": 5}, {"dtype": "float16"}, {"num_deepstack": 0},
                   {"num_deepstack": 2}):
        with pytest.raises(EncodeFailed):
            pack_inline([(ItemMeta.from_json({**d, **change}), out)], model="m", request_id="r")
        with pytest.raises(EncodeFailed):
            pack_item(ItemMeta.from_json({**d, **change}), out, model="m")
    ragged = ItemOutput(out.embedding, (out.deepstack[0][:2],))
    with pytest.raises(EncodeFailed):
        pack_inline([(meta, ragged)], model="m", request_id="r")


def test_describe_rejects_unsendable_outputs():
    with pytest.raises(EncodeFailed):
        ItemMeta.describe(ItemOutput(torch.zeros(2, 3, dtype=torch.float64)), key=key(0), grid_thw=(1, 1, 1),
                          cache="hit")
    with pytest.raises(EncodeFailed):
        ItemMeta.describe(ItemOutput(torch.zeros(6)), key=key(0), grid_thw=(1, 1, 1), cache="hit")


def _inline_body():
    return pack_inline([make(0, n_ds=1), make(1)], model="m", request_id="r")


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_truncated_bodies_raise_schema_error(data):
    body = _inline_body()
    cut = data.draw(st.integers(0, len(body) - 1))
    with pytest.raises(SchemaError):
        unpack_inline(body[:cut])


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_corrupted_bytes_never_leak_other_errors(data):
    body = bytearray(_inline_body())
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    try:
        unpack_inline(bytes(body))
    except SchemaError:
        pass


@pytest.mark.parametrize(
    "changes",
    [
        {"format": "epd-encoder/v0"},
        {"format": None},
        {"model": None},
        {"request_id": None},
        {"items": None},
        {"items": "not json"},
        {"items": json.dumps({"a": 1})},
        {"items": json.dumps([1, 2])},
    ],
)
def test_bad_metadata_raises_schema_error(changes):
    with pytest.raises(SchemaError):
        unpack_inline(rewrite_metadata(_inline_body(), **changes))


def test_tensor_metadata_mismatches_raise_schema_error():
    (m0, o0), (m1, o1) = make(0, n_ds=1), make(1)
    meta = {"format": FORMAT, "model": "m", "request_id": "r", "items": json.dumps([m0.to_json(), m1.to_json()])}
    full = {"item.0.embedding": o0.embedding, "item.0.deepstack.0": o0.deepstack[0], "item.1.embedding": o1.embedding}
    unpack_inline(st_save(full, meta))  # the unedited body is fine
    bad_bodies = [
        {k: v for k, v in full.items() if k != "item.0.deepstack.0"},  # missing tensor
        {**full, "item.2.embedding": o1.embedding.clone()},  # unexpected tensor
        {**full, "item.1.embedding": o1.embedding[:2].clone()},  # shape disagrees
        {**full, "item.1.embedding": o1.embedding.half()},  # dtype disagrees
        {**full, "item.0.deepstack.0": o0.deepstack[0][:, :2].clone()},
    ]
    for tensors in bad_bodies:
        with pytest.raises(SchemaError):
            unpack_inline(st_save(tensors, meta))


@pytest.mark.parametrize(
    "body",
    [b"", b"\x00" * 7, struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 4) + b"nope",
     struct.pack("<Q", 2) + b"[]", struct.pack("<Q", 2) + b"{}", "str body"],
)
def test_garbage_raises_schema_error(body):
    with pytest.raises(SchemaError):
        unpack_inline(body)
    with pytest.raises(SchemaError):
        unpack_item(body)


def test_inline_and_item_bodies_are_not_interchangeable():
    meta, out = make(0)
    with pytest.raises(SchemaError):
        unpack_item(pack_inline([(meta, out)], model="m", request_id="r"))
    with pytest.raises(SchemaError):
        unpack_inline(pack_item(meta, out, model="m"))
