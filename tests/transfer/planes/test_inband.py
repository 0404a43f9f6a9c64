# SPDX-License-Identifier: Apache-2.0
"""End to end over the zmq backend (bytes in band on the control channel): real sockets, real threads."""

import threading

import msgspec
import pytest
import torch
import zmq

from epd_encoder.errors import OutputMismatch, SchemaError
from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer import messages as m
from epd_encoder.transfer.sender import PushSender
from epd_encoder.types import ItemOutput
from tests.transfer import Release, assert_same, make_item, make_room, wait_for


@pytest.fixture
def rx():
    r = EmbeddingReceiver("zmq", pool_bytes=8 << 20)
    yield r
    r.close()


@pytest.fixture
def tx():
    s = PushSender(sender_id="enc-test", bootstrap_timeout=2.0, transfer_timeout=2.0)
    yield s
    s.close()


def roundtrip(rx, tx, room, items, outputs):
    rel = Release()
    tx.open(rx.delivery(room), f"req-{room}", items).deliver(outputs, rel)
    got = rx.wait(room, timeout=5)
    assert rel.wait(2) and wait_for(lambda: tx.status(room, rx.endpoint)["state"] == "done")
    assert rel.calls == 1
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n_items,n_ds", [(1, 0), (3, 0), (1, 3), (4, 2)])
def test_rooms_arrive_bit_exact(rx, tx, dtype, n_items, n_ds):
    items, outputs = make_room(n_items, tokens=7, hidden=24, dtype=dtype, n_ds=n_ds)
    got = roundtrip(rx, tx, "room", items, outputs)
    assert_same(got, outputs, items)
    assert rx.plane.pool.used_bytes == 0  # copied out and freed on wait


def test_zero_byte_items_and_empty_rooms(rx, tx):
    items, outputs = make_room(2, tokens=0, hidden=8, n_ds=1)
    got = roundtrip(rx, tx, "zero", items, outputs)
    assert_same(got, outputs, items)
    assert got[0].embedding.shape == (0, 8)
    assert roundtrip(rx, tx, "empty", [], []) == []


def test_mixed_sizes_in_one_room(rx, tx):
    pairs = [make_item(0, tokens=1, hidden=3), make_item(1, tokens=33, hidden=17, dtype="bfloat16", n_ds=1),
             make_item(2, tokens=0, hidden=5)]
    items, outputs = [p[0] for p in pairs], [p[1] for p in pairs]
    assert_same(roundtrip(rx, tx, "mixed", items, outputs), outputs, items)


def test_many_concurrent_rooms(rx, tx):
    rooms = {}
    for i in range(40):
        items, outputs = make_room(2, tokens=16, hidden=32, n_ds=i % 2, seed=i)
        rooms[f"r{i}"] = (items, outputs, Release())
    handles = [tx.open(rx.delivery(r), r, v[0]) for r, v in rooms.items()]
    threads = [threading.Thread(target=h.deliver, args=(rooms[h.room][1], rooms[h.room][2])) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, (items, outputs, rel) in rooms.items():
        assert_same(rx.wait(r, timeout=10), outputs, items)
        assert rel.wait(2)
    assert all(wait_for(lambda r=r: tx.status(r, rx.endpoint)["state"] == "done") for r in rooms)


def test_outputs_that_disagree_with_the_items_fail_before_any_byte_is_sent(rx, tx):
    items, outputs = make_room(1, tokens=4, hidden=8)
    wrong = [ItemOutput(outputs[0].embedding[:3])]
    rel = Release()
    tx.open(rx.delivery("bad"), "req", items).deliver(wrong, rel)
    with pytest.raises(OutputMismatch, match="disagrees"):
        rx.wait("bad", timeout=5)
    assert rel.calls == 1 and tx.status("bad", rx.endpoint)["code"] == "output_mismatch"
    assert rx.plane.pool.used_bytes == 0


class RogueSender:
    """A raw DEALER speaking the protocol by hand, to send what a correct sender never would."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, b"rogue")
        self.sock.setsockopt(zmq.RCVTIMEO, 3000)
        self.sock.connect(endpoint)

    def send(self, msg, *frames) -> None:
        self.sock.send_multipart([m.encode(msg), *frames])

    def recv(self):
        return m.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def rogue(rx):
    s = RogueSender(rx.endpoint)
    yield s
    s.close()


def offer_and_accept(rogue, room, items):
    rogue.send(m.Offer(room=room, request_id="q", sender="rogue", items=tuple(items),
                       total_bytes=m.layout(items)[1]))
    reply = rogue.recv()
    assert isinstance(reply, m.Accept)
    return reply


@pytest.mark.parametrize("offset,nbytes,frame_len", [
    (64, 128, 128),  # not a tensor of the layout (overlaps its end)
    (0, 128, 130),  # frame longer than its header says
    (0, 128, 100),  # shorter
    (1 << 30, 128, 128),  # far outside the region
])
def test_frames_outside_the_layout_are_refused_and_never_written(rx, rogue, offset, nbytes, frame_len):
    item, _ = make_item(tokens=4, hidden=8)  # one tensor of 128 B
    rx.expect("r")
    accept = offer_and_accept(rogue, "r", [item])
    base = accept.dest["offset"]
    before = rx.plane._buf[: 1 << 20].clone()
    rogue.send(m.Data(room="r", offset=offset, nbytes=nbytes), b"\xab" * frame_len)
    rogue.send(m.Written(room="r", total_bytes=128))
    ack = rogue.recv()
    assert isinstance(ack, m.Ack) and not ack.ok and "refused" in ack.reason
    assert torch.equal(rx.plane._buf[: 1 << 20], before), "a refused frame touched the pool"
    assert base == 0
    rogue.send(m.Complete(room="r", ok=False, code="schema_error", reason=ack.reason))
    with pytest.raises(SchemaError, match="refused"):
        rx.wait("r", timeout=3)
    assert wait_for(lambda: rx.plane.pool.used_bytes == 0)


def test_missing_tensors_and_wrong_totals_fail_the_ack(rx, rogue):
    item, out = make_item(tokens=4, hidden=8, n_ds=1)
    offer_and_accept(rogue, "r", [item])
    emb = out.embedding.numpy().tobytes()
    rogue.send(m.Data(room="r", offset=0, nbytes=128), emb)
    rogue.send(m.Written(room="r", total_bytes=m.layout([item])[1]))
    ack = rogue.recv()
    assert not ack.ok and "never arrived" in ack.reason


def test_offers_that_do_not_add_up_or_disagree_with_expectations_are_rejected(rx, rogue):
    item, _ = make_item(tokens=4, hidden=8)
    rogue.send(m.Offer(room="a", request_id="q", sender="rogue", items=(item,), total_bytes=5))
    reply = rogue.recv()
    assert isinstance(reply, m.Reject) and reply.code == "schema_error"
    other, _ = make_item(tokens=5, hidden=8)
    rx.expect("b", items=[other])
    rogue.send(m.Offer(room="b", request_id="q", sender="rogue", items=(item,), total_bytes=128))
    reply = rogue.recv()
    assert isinstance(reply, m.Reject) and "expected" in reply.reason
    assert rx.plane.pool.used_bytes == 0


def test_malformed_frames_are_counted_and_ignored(rx, tx, rogue):
    rogue.sock.send(b"\x00garbage")
    rogue.sock.send(msgspec.msgpack.encode({"type": "offer", "room": 1}))
    assert wait_for(lambda: rx.stats["malformed"] >= 2)
    items, outputs = make_room(1)
    assert_same(roundtrip(rx, tx, "after", items, outputs), outputs, items)
