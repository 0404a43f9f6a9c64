# SPDX-License-Identifier: Apache-2.0
"""The rank messages round-trip typed, refuse garbage with RankFailed, and the digest names a batch."""

from __future__ import annotations

import msgspec
import pytest

from epd_encoder.errors import RankFailed
from epd_encoder.tp.messages import (
    DIGEST_BYTES,
    Heartbeat,
    Shutdown,
    Work,
    batch_digest,
    decode,
    encode,
)


def work(**over) -> Work:
    fields = dict(seq=3, mode="data", request_ids=["r1", "r2"], item_indices=[0, 1], costs=[16, 64],
                  grids=[(1, 4, 4), (2, 4, 8)], num_tokens=[4, 16], shapes=[[16, 1176], [64, 1176]],
                  dtype="float32")
    fields.update(over)
    return Work(**fields)


@pytest.mark.parametrize("msg", [work(), Heartbeat(7), Shutdown("bye"), Shutdown()])
def test_messages_round_trip_with_their_type(msg):
    back = decode(encode(msg))
    assert type(back) is type(msg) and back == msg


def test_a_message_is_msgpack_not_pickle():
    raw = encode(Heartbeat(1))
    assert msgspec.msgpack.decode(raw) == {"type": "heartbeat", "seq": 1}


@pytest.mark.parametrize("raw", [
    b"\x80\x04garbage",  # a pickle header
    msgspec.msgpack.encode({"type": "work", "seq": 1}),  # fields missing
    msgspec.msgpack.encode({"type": "exec", "code": "import os"}),  # unknown tag
    msgspec.msgpack.encode({"type": "heartbeat", "seq": -1}),  # out of range
    msgspec.msgpack.encode({"type": "heartbeat", "seq": 1, "extra": 2}),  # unknown field
])
def test_garbage_is_a_typed_rank_failure(raw):
    with pytest.raises(RankFailed):
        decode(raw)


def test_work_with_fields_of_different_lengths_is_refused():
    bad = msgspec.msgpack.encode({**msgspec.msgpack.decode(encode(work())), "costs": [16]})
    with pytest.raises(RankFailed, match="lengths differ"):
        decode(bad)
    with pytest.raises(msgspec.ValidationError):
        work(costs=[16])


def test_digest_is_32_bytes_and_deterministic():
    d = work().digest()
    assert len(d) == DIGEST_BYTES and d == work().digest()
    assert d == batch_digest(["r1", "r2"], [0, 1], [16, 64], [(1, 4, 4), (2, 4, 8)])


@pytest.mark.parametrize("change", [
    dict(request_ids=["r1", "r3"]), dict(item_indices=[1, 0]), dict(costs=[16, 65]),
    dict(grids=[(1, 4, 4), (2, 8, 4)]), dict(request_ids=["r2", "r1"]),
])
def test_digest_changes_with_any_batch_field(change):
    assert work(**change).digest() != work().digest()


def test_digest_ignores_what_does_not_define_the_batch():
    # seq and shapes differ between otherwise equal batches on purpose: the digest is the batch.
    assert work(seq=9, shapes=[[1, 1], [2, 2]]).digest() == work().digest()


def test_digest_ids_cannot_run_into_each_other():
    a = batch_digest(["ab", "c"], [0, 0], [1, 1], [(1, 1, 1)] * 2)
    b = batch_digest(["a", "bc"], [0, 0], [1, 1], [(1, 1, 1)] * 2)
    assert a != b
