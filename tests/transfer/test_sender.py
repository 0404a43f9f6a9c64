# SPDX-License-Identifier: Apache-2.0
"""PushSender: validation, release/on_done exactly once, status records, non-blocking deliver."""

import socket
import threading
import time

import pytest

from epd_encoder.errors import Cancelled, ConfigError, DuplicateRequest, EncodeFailed, NotReady, Overloaded, SchemaError
from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer.sender import PushSender
from tests.transfer import Release, assert_same, make_room, wait_for


def dead_endpoint() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


def delivery(room="r", endpoint=None, **kw):
    return {"mode": "push", "backend": "tcp", "room": room,
            "targets": [{"endpoint": endpoint or dead_endpoint(), "rank": 0, "info": {}}], **kw}


@pytest.fixture
def tx():
    s = PushSender(sender_id="enc-tx-test", bootstrap_timeout=30.0, transfer_timeout=30.0, record_ttl=30.0,
                   max_records=3)
    yield s
    s.close()


def test_open_validates_the_delivery_and_the_items(tx):
    items, _ = make_room(1)
    with pytest.raises(SchemaError):
        tx.open({"mode": "push", "backend": "tcp", "room": "r", "targets": []}, "q", items)
    with pytest.raises(SchemaError, match="items"):
        tx.open(delivery(), "q", [{"key": "k", "num_tokens": -1}])
    d = delivery("ok")
    h = tx.open(d, "q", items)
    assert h.state == "pending" and tx.status("ok", d["targets"][0]["endpoint"])["state"] == "pending"
    with pytest.raises(DuplicateRequest):
        tx.open(d, "q", items)


def test_deliver_never_blocks_even_towards_a_dead_peer():
    # A deliver that waited on the peer would take the 60 s bootstrap timeout.
    s = PushSender(sender_id="enc-tx-patient", bootstrap_timeout=60.0, transfer_timeout=60.0)
    items, outputs = make_room(1, tokens=256, hidden=256)
    rel = Release()
    dead = dead_endpoint()
    try:
        h = s.open(delivery("dead", dead), "q", items)
        t0 = time.monotonic()
        h.deliver(outputs, rel)
        assert time.monotonic() - t0 < 10
        assert s.status("dead", dead)["state"] == "sending" and rel.calls == 0
    finally:
        s.close()
    assert rel.calls == 1 and s.status("dead", dead)["code"] == Cancelled.code


def test_release_and_on_done_run_exactly_once_per_room(tx):
    items, outputs = make_room(1)
    seen = []
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        rel = Release()
        h = tx.open(rx.delivery("a"), "q", items, on_done=seen.append)
        h.deliver(outputs, rel)
        rx.wait("a", timeout=3)
        assert rel.wait(2) and wait_for(lambda: len(seen) == 1)
        h.fail(EncodeFailed("too late"))  # a no-op after the end
        h.deliver(outputs, rel2 := Release())
        assert rel.calls == 1 and rel2.calls == 1 and len(seen) == 1 and seen[0]["state"] == "done"
    dead = dead_endpoint()
    failed = tx.open(delivery("b", dead), "q", items)
    failed.fail(EncodeFailed("tower oom"))
    late = Release()
    failed.deliver(outputs, late)  # outputs after the failure: released, nothing sent
    assert late.calls == 1
    st = tx.status("b", dead)
    assert st["state"] == "failed" and st["code"] == "encode_failed" and st["reason"] == "tower oom"


def test_status_records_are_bounded_by_count(tx):
    items, _ = make_room(1)
    dead = dead_endpoint()
    for i in range(5):
        tx.open(delivery(f"r{i}", dead), "q", items).fail(EncodeFailed("x"))
    assert [tx.status(f"r{i}", dead) is not None for i in range(5)] == [False, False, True, True, True]
    assert tx.status("never", dead) is None


def test_status_records_age_out():
    s = PushSender(sender_id="enc-tx-ttl", record_ttl=0.5)
    try:
        dead = dead_endpoint()
        s.open(delivery("r", dead), "q", make_room(1)[0]).fail(EncodeFailed("x"))
        assert wait_for(lambda: s.status("r", dead) is None, timeout=20)
    finally:
        s.close()


def test_close_fails_live_rooms_and_refuses_new_ones():
    s = PushSender(sender_id="closing", bootstrap_timeout=5.0)
    items, outputs = make_room(1)
    rel = Release()
    dead = dead_endpoint()
    s.open(delivery("live", dead), "q", items).deliver(outputs, rel)
    pending = s.open(delivery("pending"), "q", items)
    s.close()
    assert rel.calls == 1
    assert s.status("live", dead)["code"] == Cancelled.code and pending.state == "failed"
    with pytest.raises(NotReady):
        s.open(delivery("new"), "q", items)


def test_idle_peer_threads_retire():
    s = PushSender(sender_id="idle", bootstrap_timeout=1.0, peer_idle_s=0.2)  # the room outlives the check
    try:
        items, outputs = make_room(1)
        s.open(delivery("x"), "q", items).deliver(outputs, Release())
        assert len(s._peers) == 1
        assert wait_for(lambda: not s._peers, timeout=3)
    finally:
        s.close()


def test_room_names_are_scoped_to_their_receivers(tx):
    items, _ = make_room(1)
    a, b, shared = dead_endpoint(), dead_endpoint(), dead_endpoint()
    tx.open(delivery("room-1", a), "q1", items)
    tx.open(delivery("room-1", b), "q2", items)  # another prefill, the same name
    assert tx.status("room-1", a)["request_id"] == "q1" and tx.status("room-1", b)["request_id"] == "q2"
    assert tx.status("room-1", shared) is None
    with pytest.raises(DuplicateRequest):  # the same receiver while the first is open
        tx.open(delivery("room-1", a), "q3", items)
    tp = delivery("tp", shared)
    tp["targets"].append({"endpoint": a, "rank": 1, "info": {}})
    tx.open(tp, "q4", items)
    assert tx.status("tp", shared)["request_id"] == "q4"
    assert tx.status("tp", a) is None  # found by its rank-0 receiver only
    with pytest.raises(DuplicateRequest):  # rank 1's receiver already has a live "tp" on the wire
        tx.open(delivery("tp", a), "q5", items)


def test_close_lets_open_rooms_finish_within_its_timeout():
    items, outputs = make_room(1)
    s = PushSender(sender_id="draining", bootstrap_timeout=30.0)
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        s.open(rx.delivery("open"), "q", items).deliver(outputs, Release())
        t0 = time.monotonic()
        s.close(timeout=60.0)
        assert time.monotonic() - t0 < 30  # returned when the room ended, not at the timeout
        assert_same(rx.wait("open", timeout=5), outputs, items)
    assert s.status("open", rx.endpoint)["state"] == "done"


def test_close_cancels_the_rooms_its_timeout_did_not_see_end():
    s = PushSender(sender_id="draining-dead", bootstrap_timeout=30.0)
    items, outputs = make_room(1)
    stuck, rel = dead_endpoint(), Release()
    s.open(delivery("stuck", stuck), "q", items).deliver(outputs, rel)
    t0 = time.monotonic()
    s.close(timeout=0.3)
    assert time.monotonic() - t0 >= 0.3 and rel.calls == 1
    assert s.status("stuck", stuck)["code"] == Cancelled.code


def test_a_room_that_needs_a_peer_slot_it_cannot_have_is_refused_at_open():
    s = PushSender(sender_id="slots", bootstrap_timeout=30.0, max_peers=3, proven_slots=1)
    items, _ = make_room(1)
    a, b = dead_endpoint(), dead_endpoint()
    try:
        s.open(delivery("a", a), "q", items)
        s.open(delivery("b", b), "q", items)  # the 2 slots for endpoints that never answered
        with pytest.raises(Overloaded, match="never answered"):
            s.precheck(delivery("c"))
        with pytest.raises(Overloaded, match="never answered"):
            s.open(delivery("c"), "q", items)
        assert s.status("c", a) is None and len(s._peers) == 2
        s.open(delivery("a2", a), "q", items)  # an endpoint already connected needs no slot
    finally:
        s.close()


def test_slots_are_kept_for_receivers_that_answered_even_after_their_peer_retired():
    s = PushSender(sender_id="reserve", bootstrap_timeout=30.0, max_peers=3, proven_slots=1, peer_idle_s=0.1)
    items, outputs = make_room(1)
    try:
        with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx, EmbeddingReceiver("tcp", pool_bytes=1 << 20) as new:
            s.open(rx.delivery("first"), "q", items).deliver(outputs, Release())
            assert_same(rx.wait("first", timeout=10), outputs, items)
            assert wait_for(lambda: not s._peers, timeout=10)  # idle: rx's peer retired
            s.open(delivery("d1"), "q", items)
            s.open(delivery("d2"), "q", items)  # endpoints that never answered fill their share
            with pytest.raises(Overloaded):
                s.open(new.delivery("unproven"), "q", items)  # a receiver this sender never heard from
            s.open(rx.delivery("again"), "q", items).deliver(outputs, Release())  # the kept slot
            assert_same(rx.wait("again", timeout=10), outputs, items)
            with pytest.raises(Overloaded, match="max_peers=3"):
                s.open(delivery("d3"), "q", items)
    finally:
        s.close()


def test_a_peer_whose_offer_found_no_receiver_retires_at_once():
    s = PushSender(sender_id="dead-retire", bootstrap_timeout=0.3, peer_idle_s=600.0)
    items, outputs = make_room(1)
    dead = dead_endpoint()
    try:
        s.open(delivery("x", dead), "q", items).deliver(outputs, Release())
        assert wait_for(lambda: (s.status("x", dead) or {}).get("code") == "timeout", timeout=10)
        assert wait_for(lambda: not s._peers, timeout=10)  # not after the 600 s idle timeout
        # its thread ends just after it leaves the table: waited for, well inside the 600 s
        assert wait_for(lambda: not [t for t in threading.enumerate() if t.name == f"epd-tx-{dead}"], timeout=10)
    finally:
        s.close()


def test_a_peer_whose_rooms_all_ended_before_an_offer_retires_at_once():
    # A room that fails before its outputs are ready (tower error, request timeout) never offers:
    # its endpoint never answered, so its peer must not hold an unproven slot for the idle timeout.
    s = PushSender(sender_id="never-offered", bootstrap_timeout=30.0, peer_idle_s=600.0,
                   max_peers=2, proven_slots=1)
    items, _ = make_room(1)
    try:
        s.open(delivery("early"), "q", items).fail(EncodeFailed("tower oom"))
        assert wait_for(lambda: not s._peers, timeout=10)  # not after the 600 s idle timeout
        s.open(delivery("next"), "q", items)  # the one unproven slot is free again
    finally:
        s.close()


def test_an_open_room_holds_its_peer_until_it_ends():
    s = PushSender(sender_id="held", bootstrap_timeout=30.0, peer_idle_s=0.05)
    items, _ = make_room(1)
    dead = dead_endpoint()
    try:
        h = s.open(delivery("pending", dead), "q", items)  # its outputs are not ready yet
        peer = s._peers[dead]
        assert not wait_for(lambda: not peer.thread.is_alive(), timeout=0.5)
        h.fail(EncodeFailed("tower oom"))
        assert wait_for(lambda: not s._peers, timeout=10)
    finally:
        s.close()


def test_proven_slots_must_leave_room_for_new_receivers():
    with pytest.raises(ConfigError):
        PushSender(sender_id="bad", max_peers=4, proven_slots=4)
