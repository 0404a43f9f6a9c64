# SPDX-License-Identifier: Apache-2.0
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from epd_encoder.transfer import messages as m
from epd_encoder.transfer.control import error_for_code, parse_delivery
from epd_encoder.errors import EncoderError, Overloaded, RequestTimeout, SchemaError

ITEM = m.WireItem(key="k" * 64, num_tokens=5, grid_thw=(1, 4, 5), hidden_size=16, dtype="bfloat16",
                  num_deepstack=2)

EVERY = [
    m.Offer(room="r", request_id="q", sender="s", items=(ITEM, ITEM), total_bytes=123),
    m.Accept(room="r", dest={"offset": 64, "nbytes": 10, "segment": "x"}),
    m.Reject(room="r", reason="full", code="overloaded"),
    m.Data(room="r", offset=0, nbytes=0),
    m.Written(room="r", total_bytes=9),
    m.Ack(room="r", ok=False, reason="bad", code="schema_error"),
    m.Complete(room="r", ok=True),
    m.Complete(room="r", ok=False, code="timeout", reason="late"),
    m.Abort(room="r", reason="gone"),
]


@pytest.mark.parametrize("msg", EVERY, ids=lambda x: type(x).__name__)
def test_every_message_round_trips(msg):
    assert m.decode(m.encode(msg)) == msg
    assert m.decode(memoryview(m.encode(msg))) == msg


@pytest.mark.parametrize("frame", [b"", b"\xc1", m.encode(m.Abort(room="r", reason="x"))[:-2],
                                   msgspec.msgpack.encode({"type": "nope", "room": "r"}),
                                   msgspec.msgpack.encode({"type": "ack", "room": "r"}),
                                   msgspec.msgpack.encode({"type": "data", "room": "r", "offset": -1, "nbytes": 3}),
                                   msgspec.msgpack.encode([1, 2, 3])])
def test_malformed_frames_raise(frame):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        m.decode(frame)


def test_wire_item_constraints_are_enforced_on_decode():
    bad = msgspec.to_builtins(m.Offer(room="r", request_id="q", sender="s", items=(ITEM,), total_bytes=1))
    for field, value in (("num_tokens", -1), ("hidden_size", 0), ("dtype", "int8"), ("num_deepstack", -2)):
        doc = {**bad, "items": [{**bad["items"][0], field: value}]}
        with pytest.raises(msgspec.ValidationError):
            m.decode(msgspec.msgpack.encode(doc))


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 50), st.sampled_from(["float32", "bfloat16"]),
                          st.integers(0, 3)), max_size=6))
def test_layout_is_aligned_disjoint_and_covers_every_tensor(specs):
    items = [m.WireItem(key=str(i), num_tokens=t, grid_thw=(1, 1, 1), hidden_size=h, dtype=d, num_deepstack=k)
             for i, (t, h, d, k) in enumerate(specs)]
    offsets, total = m.layout(items)
    flat = [c for per in offsets for c in per]
    assert len(flat) == sum(1 + k for *_, k in specs)
    end = 0
    for (off, n), item in zip(flat, [it for it in items for _ in range(1 + it.num_deepstack)]):
        assert off % m.ALIGN == 0 and off >= end and n == m.item_tensor_bytes(item)
        end = off + n
    assert end <= total and total % m.ALIGN == 0


def test_error_for_code_maps_back_to_the_class():
    assert type(error_for_code("overloaded", "x")) is Overloaded
    assert type(error_for_code("timeout", "x")) is RequestTimeout
    e = error_for_code("no-such-code", "why")
    assert type(e) is EncoderError and str(e) == "why"


GOOD = {"mode": "push", "backend": "tcp", "room": "r1", "bootstrap_timeout": 2.5,
        "targets": [{"endpoint": "tcp://127.0.0.1:5000", "rank": 0, "info": {}},
                    {"endpoint": "tcp://127.0.0.1:5001", "rank": 1, "info": {"a": 1}}]}


def test_parse_delivery_accepts_the_documented_shape_and_round_trips():
    d = parse_delivery(GOOD)
    assert d.room == "r1" and d.backend == "tcp" and d.bootstrap_timeout == 2.5
    assert [t.rank for t in d.targets] == [0, 1]
    assert parse_delivery(d.to_json()) == d
    assert parse_delivery({**GOOD, "room": 2**63 - 1}).room == str(2**63 - 1)  # an int room is its decimal string


@pytest.mark.parametrize("patch", [
    {"mode": "inline"}, {"backend": "carrier-pigeon"}, {"room": ""}, {"room": 7.0}, {"room": "a b"}, {"targets": []},
    {"targets": "x"}, {"bootstrap_timeout": 0}, {"bootstrap_timeout": True}, {"bootstrap_timeout": float("nan")},
    {"targets": [{"endpoint": "http://x", "rank": 0}]}, {"targets": [{"endpoint": "tcp://", "rank": 0}]},
    {"targets": [{"endpoint": "tcp://a", "rank": 0}]}, {"bootstrap_timeout": 601},
    {"targets": [{"endpoint": "tcp://a:1", "rank": -1}]},
    {"targets": [{"endpoint": "tcp://a:1", "rank": 0}, {"endpoint": "tcp://a:1", "rank": 1}]},
    {"targets": [{"endpoint": "tcp://a:1", "rank": 0}, {"endpoint": "tcp://a:2", "rank": 0}]},
    {"targets": [{"endpoint": "tcp://a:1", "rank": 0, "info": []}]},
])
def test_parse_delivery_rejects_bad_fields(patch):
    with pytest.raises(SchemaError):
        parse_delivery({**GOOD, **patch})
    with pytest.raises(SchemaError):
        parse_delivery("not a dict")
