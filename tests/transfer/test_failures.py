# SPDX-License-Identifier: Apache-2.0
"""Every failure path of docs/protocol.md, each ending in one terminal state on both sides."""

import time

import pytest
import zmq

from epd_encoder.errors import Cancelled, EncodeFailed, Overloaded, RequestTimeout
from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer import messages as m
from epd_encoder.transfer.sender import PushSender
from tests.transfer import Release, assert_same, make_room, wait_for
from tests.transfer.test_sender import dead_endpoint, delivery


@pytest.fixture
def tx():
    s = PushSender(sender_id="enc-fail", bootstrap_timeout=0.4, transfer_timeout=0.4, max_queue_per_peer=4)
    yield s
    s.close()


@pytest.fixture
def patient():
    """For tests where no timeout may fire: an answer that beat 60 s was prompt."""
    s = PushSender(sender_id="enc-patient", bootstrap_timeout=60.0, transfer_timeout=60.0)
    yield s
    s.close()


class RogueReceiver:
    """A raw ROUTER that answers only what a test tells it to."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVTIMEO, 3000)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def recv(self):
        frames = self.sock.recv_multipart()
        return frames[0], m.decode(frames[1])

    def send(self, ident, msg) -> None:
        self.sock.send_multipart([ident, m.encode(msg)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def rogue():
    r = RogueReceiver()
    yield r
    r.close()


def test_encode_failure_before_offer_reaches_a_later_wait_at_once(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        items, _ = make_room(1)
        tx.open(rx.delivery("r"), "q", items).fail(EncodeFailed("tower raised CUDA OOM"))
        assert wait_for(lambda: rx.poll("r") == "failed")
        with pytest.raises(EncodeFailed, match="CUDA OOM"):
            rx.wait("r", timeout=0)  # answered from the record: no waiting allowed
        assert rx.plane.pool.used_bytes == 0


def test_receiver_closed_before_the_offer(tx):
    rx = EmbeddingReceiver("tcp", pool_bytes=1 << 20)
    d = rx.delivery("r")
    rx.close()
    items, outputs = make_room(1)
    rel = Release()
    tx.open(d, "q", items).deliver(outputs, rel)
    assert rel.wait(3)
    st = tx.status("r", rx.endpoint)
    assert st["code"] == RequestTimeout.code and "accepted" in st["reason"]


def test_no_receiver_within_the_bootstrap_timeout_frees_the_sender(tx):
    items, outputs = make_room(1)
    rel = Release()
    t0 = time.monotonic()
    dead = dead_endpoint()
    tx.open(delivery("r", dead), "q", items).deliver(outputs, rel)
    assert rel.wait(10) and 0.3 < time.monotonic() - t0 < 5  # at its bootstrap timeout (0.4 s)
    assert tx.status("r", dead)["state"] == "failed"
    assert wait_for(lambda: all(p.load == 0 for p in tx._peers.values()))


def test_receiver_gone_mid_transfer_fails_on_the_transfer_timeout(rogue):
    # Only the transfer timeout is short: the rogue's Accept cannot miss the bootstrap.
    tx = PushSender(sender_id="enc-gone", bootstrap_timeout=60.0, transfer_timeout=0.4)
    try:
        items, outputs = make_room(1)
        rel = Release()
        tx.open(delivery("r", rogue.endpoint, backend="zmq"), "q", items).deliver(outputs, rel)  # in-band
        ident, offer = rogue.recv()
        assert isinstance(offer, m.Offer)
        rogue.send(ident, m.Accept(room="r", dest={"offset": 0, "nbytes": offer.total_bytes}))
        kinds = {type(rogue.recv()[1]) for _ in range(2)}  # Data, Written; then silence (no Ack)
        assert kinds == {m.Data, m.Written}
        assert rel.wait(10)
        st = tx.status("r", rogue.endpoint)
        assert st["code"] == RequestTimeout.code and "acknowledge" in st["reason"]
        _, complete = rogue.recv()
        assert isinstance(complete, m.Complete) and not complete.ok and complete.code == "timeout"
    finally:
        tx.close()


def test_receiver_close_mid_transfer_aborts_the_sender_promptly():
    items, _ = make_room(1)
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"hand-sender")
        dealer.setsockopt(zmq.RCVTIMEO, 3000)
        dealer.connect(rx.endpoint)
        rx.expect("r")
        dealer.send(m.encode(m.Offer(room="r", request_id="q", sender="hand", items=tuple(items),
                                     total_bytes=m.layout(items)[1])))
        assert isinstance(m.decode(dealer.recv()), m.Accept)
        assert rx.plane.pool.used_bytes > 0
        rx.close()
        abort = m.decode(dealer.recv())
        assert isinstance(abort, m.Abort) and abort.room == "r" and "closed" in abort.reason
        dealer.close(0)
        ctx.term()


def test_abort_on_receiver_wait_timeout_frees_the_sender_side(patient):
    tx = patient
    items, outputs = make_room(1, tokens=64, hidden=64)
    with EmbeddingReceiver("tcp", pool_bytes=20 << 10, bootstrap_timeout=60.0) as rx:
        tx.open(rx.delivery("hog"), "q", items).deliver(outputs, Release())
        assert wait_for(lambda: rx.poll("hog") == "done")  # unclaimed: the pool is full
        rel = Release()
        tx.open(rx.delivery("r"), "q", items).deliver(outputs, rel)
        with pytest.raises(RequestTimeout):
            rx.wait("r", timeout=0.3)
        assert rel.wait(20)  # on the receiver's Abort, well before the 60 s timeouts
        st = tx.status("r", rx.endpoint)
        assert st["code"] == Cancelled.code and "wait timed out" in st["reason"]


def test_a_stalled_receiver_delays_only_its_own_rooms(rogue):
    tx = PushSender(sender_id="enc-stall", bootstrap_timeout=60.0, max_queue_per_peer=3)
    try:
        items, outputs = make_room(1, tokens=32, hidden=32)
        stalled = [Release() for _ in range(3)]
        for i, rel in enumerate(stalled):  # the rogue never accepts
            tx.open(delivery(f"s{i}", rogue.endpoint), "q", items).deliver(outputs, rel)
        over = Release()
        tx.open(delivery("s-over", rogue.endpoint), "q", items).deliver(outputs, over)
        assert over.calls == 1  # failed at once, inside deliver: not queued
        st = tx.status("s-over", rogue.endpoint)
        assert st["code"] == Overloaded.code and "full" in st["reason"]
        with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
            t0 = time.monotonic()
            for i in range(10):  # in pairs: the good peer's own bound is 3 rooms in flight
                tx.open(rx.delivery(f"g{i}"), "q", items).deliver(outputs, Release())
                if i % 2:
                    assert_same(rx.wait(f"g{i - 1}", timeout=30), outputs, items)
                    assert_same(rx.wait(f"g{i}", timeout=30), outputs, items)
            assert time.monotonic() - t0 < 30  # never behind the stalled rooms' 60 s bootstrap
        assert all(tx.status(f"s{i}", rogue.endpoint)["state"] == "sending" for i in range(3))
        assert all(rel.calls == 0 for rel in stalled)
    finally:
        tx.close()


def test_a_reject_fails_the_room_with_the_receivers_code(patient, rogue):
    tx = patient
    items, outputs = make_room(1)
    rel = Release()
    tx.open(delivery("r", rogue.endpoint), "q", items).deliver(outputs, rel)
    ident, _ = rogue.recv()
    rogue.send(ident, m.Reject(room="r", reason="pool is on fire", code="overloaded"))
    assert rel.wait(3)
    st = tx.status("r", rogue.endpoint)
    assert st["code"] == "overloaded" and "pool is on fire" in st["reason"]


def test_a_rogue_abort_before_accept_fails_promptly(patient, rogue):
    tx = patient
    items, outputs = make_room(1)
    rel = Release()
    tx.open(delivery("r", rogue.endpoint), "q", items).deliver(outputs, rel)
    ident, _ = rogue.recv()
    rogue.send(ident, m.Abort(room="r", reason="prefill cancelled"))
    assert rel.wait(20)  # on the Abort, far before the 60 s bootstrap timeout
    assert tx.status("r", rogue.endpoint)["code"] == Cancelled.code


def test_a_room_whose_bytes_are_never_taken_holds_its_receivers_next_room_until_the_transfer_timeout(rogue):
    """docs/protocol.md, "One writer per receiver": the rooms to one endpoint are written one at
    a time, so a write the receiver never takes delays that receiver's next room until the
    transfer timeout fails it; then the next room is written and completes."""
    import socket

    from epd_encoder.transfer.base import receiver_plane_factory

    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(8)  # connections complete in the kernel; nothing ever reads them
    plane = receiver_plane_factory("tcp")(pool_bytes=1 << 20, host="127.0.0.1", advertise_host=None)
    tx = PushSender(sender_id="enc-one-writer", bootstrap_timeout=60.0, transfer_timeout=1.0)
    try:
        big_items, big_outputs = make_room(1, tokens=4096, hidden=2048)  # 32 MiB: past any socket buffer
        items, outputs = make_room(1)
        to_sink = {"data_host": "127.0.0.1", "data_port": sink.getsockname()[1]}
        rooms = {"stuck": (to_sink, big_items, big_outputs, Release()),
                 "next": (plane.info(), items, outputs, Release())}
        for name, (info, its, outs, rel) in rooms.items():
            d = {"mode": "push", "backend": "tcp", "room": name,
                 "targets": [{"endpoint": rogue.endpoint, "rank": 0, "info": info}]}
            tx.open(d, name, its).deliver(outs, rel)
        offers = dict((offer.room, (ident, offer)) for ident, offer in (rogue.recv(), rogue.recv()))
        ident = offers["stuck"][0]
        rogue.send(ident, m.Accept(room="stuck", dest={"token": "ab" * 16, "nbytes": offers["stuck"][1].total_bytes}))
        region = plane.allocate(offers["next"][1].total_bytes)
        rogue.send(ident, m.Accept(room="next", dest=plane.destination(region)))
        rogue.sock.setsockopt(zmq.RCVTIMEO, 30000)  # the stuck write gives up only after its stall
        t0 = time.monotonic()
        while not isinstance(msg := rogue.recv()[1], m.Written):  # the stuck room's Complete may come first
            assert isinstance(msg, m.Complete) and msg.room == "stuck"
        assert msg.room == "next" and time.monotonic() - t0 >= 1.0  # held for the stuck write's timeout
        stuck = tx.status("stuck", rogue.endpoint)  # it had ended before the next room was written
        assert stuck["state"] == "failed" and stuck["code"] == RequestTimeout.code and "stalled" in stuck["reason"]
        assert rooms["stuck"][3].calls == 1
        rogue.send(ident, m.Ack(room="next", ok=True))
        assert rooms["next"][3].wait(10) and tx.status("next", rogue.endpoint)["state"] == "done"
        plane.free(region)
    finally:
        tx.close()
        plane.close()
        sink.close()
