# SPDX-License-Identifier: Apache-2.0
"""The receiver's poll-driven API, copy-out and zero-copy semantics, pool waiting and bounded records."""

import time

import pytest
import torch

from epd_encoder.errors import (Cancelled, DuplicateRequest, EncodeFailed, NotFound, NotReady, Overloaded,
                                RequestTimeout)
from epd_encoder.receiver import EmbeddingReceiver, ReceivedItem
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.messages import layout
from epd_encoder.transfer.sender import PushSender
from tests.transfer import Release, assert_same, make_room, wait_for


@pytest.fixture
def tx():
    s = PushSender(sender_id="enc-rx-test", bootstrap_timeout=30.0, transfer_timeout=30.0)
    yield s
    s.close()


def send(tx, rx, room, items, outputs, **kw):
    rel = Release()
    tx.open(rx.delivery(room, **kw), room, items).deliver(outputs, rel)
    return rel


def test_delivery_object_is_the_documented_json(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, bootstrap_timeout=4.0) as rx:
        d = rx.delivery("room-1")
        assert d == {"mode": "push", "backend": "tcp", "room": "room-1", "bootstrap_timeout": 4.0,
                     "targets": [{"endpoint": rx.endpoint, "rank": 0, "info": rx.plane.info()}]}
        assert rx.endpoint.startswith("tcp://127.0.0.1:") and not rx.endpoint.endswith(":0")
        assert rx.poll("room-1") == "pending"


def test_poll_driven_job_api(tx):
    with EmbeddingReceiver("tcp", pool_bytes=4 << 20) as rx:
        items, outputs = make_room(2, n_ds=1)
        rx.expect("a", items=items)
        with pytest.raises(NotReady):
            rx.result("a")
        assert rx.ready_rooms() == []
        send(tx, rx, "a", items, outputs)
        assert wait_for(lambda: rx.poll("a") == "done")
        assert rx.ready_rooms() == ["a"]
        got = rx.result("a")
        assert all(isinstance(x, ReceivedItem) for x in got)
        assert_same(got, outputs, items)
        with pytest.raises(NotFound):  # a done room is consumed by its result
            rx.poll("a")
        with pytest.raises(NotFound):
            rx.result("never-heard-of")
        assert rx.ready_rooms() == []


def test_results_are_copies_and_the_region_is_freed(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        items, outputs = make_room(1, tokens=8, hidden=16)
        send(tx, rx, "a", items, outputs)
        assert wait_for(lambda: rx.poll("a") == "done")
        assert rx.plane.pool.used_bytes == layout(items)[1]
        got = rx.result("a")
        assert rx.plane.pool.used_bytes == 0
        rx.plane._buf.fill_(7)  # later rooms reuse the pool: the result must not change
        assert torch.equal(got[0].embedding, outputs[0].embedding)


def test_a_failed_room_keeps_answering_with_its_error(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        items, _ = make_room(1)
        tx.open(rx.delivery("f"), "f", items).fail(EncodeFailed("tower fell over"))
        for _ in range(2):
            with pytest.raises(EncodeFailed, match="tower fell over"):
                rx.wait("f", timeout=3)
        assert rx.poll("f") == "failed" and rx.ready_rooms() == ["f"]
        rx.discard("f")
        with pytest.raises(NotFound):
            rx.poll("f")


def waiting_for_pool(rx, room: str) -> bool:
    with rx._lock:
        r = rx._find(room)
        return r is not None and r.state == "waiting_pool"


def test_an_offer_waits_for_pool_space_then_proceeds(tx):
    items, outputs = make_room(1, tokens=64, hidden=64)  # 16 KiB per room
    # A long bootstrap: the Offer may wait for the pool far longer than this test takes.
    with EmbeddingReceiver("tcp", pool_bytes=20 << 10, bootstrap_timeout=60.0) as rx:
        send(tx, rx, "first", items, outputs)
        assert wait_for(lambda: rx.poll("first") == "done")
        send(tx, rx, "second", items, outputs)  # cannot fit while "first" is unclaimed
        assert wait_for(lambda: waiting_for_pool(rx, "second"), timeout=20)
        assert rx.poll("second") == "pending"
        rx.result("first")
        assert_same(rx.wait("second", timeout=3), outputs, items)


def test_an_offer_that_waits_past_the_bootstrap_timeout_fails_with_overloaded(tx):
    items, outputs = make_room(1, tokens=64, hidden=64)
    # The receiver refuses after half its bootstrap timeout: 1 s ahead of the sender's own.
    with EmbeddingReceiver("tcp", pool_bytes=20 << 10, bootstrap_timeout=2.0) as rx:
        send(tx, rx, "first", items, outputs)
        assert wait_for(lambda: rx.poll("first") == "done")
        rel = send(tx, rx, "second", items, outputs)
        with pytest.raises(Overloaded, match="receive pool"):
            rx.wait("second", timeout=3)
        assert rel.wait(2) and tx.status("second", rx.endpoint)["code"] == "overloaded"


def test_expect_timeout_fails_a_room_nobody_delivers():
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        rx.expect("late", timeout=0.2)
        assert wait_for(lambda: rx.poll("late") == "failed", timeout=2)
        with pytest.raises(RequestTimeout):
            rx.result("late")


def test_wait_timeout_raises_request_timeout_and_fails_the_room():
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            rx.wait("nobody", timeout=0.2)
        assert time.monotonic() - t0 < 10  # it ends at its timeout: no hang
        assert rx.poll("nobody") == "failed"


def test_records_are_bounded_by_count(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, record_ttl=300, max_records=3) as rx:
        items, _ = make_room(1)
        for i in range(5):
            tx.open(rx.delivery(f"f{i}"), "q", items).fail(EncodeFailed("x"))
        assert wait_for(lambda: len(rx.ready_rooms()) == 3 and "f4" in rx.ready_rooms())
        assert sorted(rx.ready_rooms()) == ["f2", "f3", "f4"]  # oldest crowded out


def test_records_and_unclaimed_rooms_age_out(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, record_ttl=1.0) as rx:
        items, outputs = make_room(1)
        tx.open(rx.delivery("f"), "q", items).fail(EncodeFailed("x"))
        assert wait_for(lambda: rx.ready_rooms() == ["f"])
        send(tx, rx, "done-unclaimed", items, outputs, timeout=60)  # done long before that
        assert wait_for(lambda: rx.plane.pool.used_bytes > 0)
        assert wait_for(lambda: rx.ready_rooms() == [] and rx.plane.pool.used_bytes == 0, timeout=20)
        with pytest.raises(NotFound):
            rx.poll("done-unclaimed")


def test_unknown_room_failure_records_are_bounded(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, record_ttl=30, max_records=2) as rx:
        items, _ = make_room(1)
        target = rx.target()
        for i in range(4):  # a Complete racing ahead of delivery(): the room is unknown here
            d = {"mode": "push", "backend": "tcp", "room": f"u{i}", "targets": [target]}
            tx.open(d, "q", items).fail(EncodeFailed(f"boom {i}"))
        assert wait_for(lambda: rx._orphans.get("u3") is not None)
        assert len(rx._orphans) == 2 and rx.ready_rooms() == []
        with pytest.raises(EncodeFailed, match="boom 3"):
            rx.wait("u3", timeout=0)  # the recorded failure answers at once: no waiting allowed
        with pytest.raises(NotFound):
            rx.poll("u0")


def test_close_aborts_pending_rooms_and_rejects_new_calls():
    rx = EmbeddingReceiver("tcp", pool_bytes=1 << 20)
    rx.expect("p")
    rx.close()
    assert rx.poll("p") == "failed"
    with pytest.raises(NotReady):
        rx.expect("q")
    rx.close()  # idempotent


# --- zero-copy receive (copy=False) ------------------------------------------------------

ZERO_COPY_BACKENDS = ["tcp", "zmq", "shm"]


def _inside(t: torch.Tensor, pool: torch.Tensor) -> bool:
    start = pool.data_ptr()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + pool.numel()


@pytest.mark.parametrize("backend", ZERO_COPY_BACKENDS)
def test_zero_copy_results_are_views_held_until_release(tx, backend):
    with EmbeddingReceiver(backend, pool_bytes=1 << 20) as rx:
        items, outputs = make_room(2, tokens=8, hidden=16, n_ds=1)
        send(tx, rx, "a", items, outputs)
        got = rx.wait("a", timeout=3, copy=False)
        assert_same(got, outputs, items)
        pool_view = rx.plane.view(Region(0, rx.plane.pool.capacity))
        assert all(_inside(t, pool_view) for it in got for t in [it.embedding, *it.deepstack])
        assert rx.plane.pool.used_bytes == layout(items)[1] and rx.held_rooms() == ["a"]
        with pytest.raises(NotFound):  # consumed, like a copied result
            rx.poll("a")
        # Another room cannot get the held bytes: its data lands elsewhere.
        other_items, other_outputs = make_room(2, tokens=8, hidden=16, n_ds=1, seed=9)
        send(tx, rx, "b", other_items, other_outputs)
        assert_same(rx.wait("b", timeout=3), other_outputs, other_items)
        assert_same(got, outputs, items)
        assert rx.release("a") is True
        assert rx.release("a") is False  # idempotent
        assert rx.held_rooms() == [] and rx.plane.pool.used_bytes == 0
        assert rx.plane.pool.free_blocks() == [(0, rx.plane.pool.capacity)]


def test_a_held_room_counts_against_the_pool(tx):
    items, outputs = make_room(1, tokens=64, hidden=64)  # 16 KiB per room
    with EmbeddingReceiver("tcp", pool_bytes=20 << 10, bootstrap_timeout=60.0) as rx:
        send(tx, rx, "held", items, outputs)
        got = rx.wait("held", timeout=3, copy=False)
        send(tx, rx, "next", items, outputs)
        assert wait_for(lambda: waiting_for_pool(rx, "next"), timeout=20)  # waits for the held region
        assert rx.poll("next") == "pending"
        assert_same(got, outputs, items)
        rx.release("held")
        assert_same(rx.wait("next", timeout=3), outputs, items)


def test_a_held_room_keeps_its_name_until_release(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        items, outputs = make_room(1)
        send(tx, rx, "a", items, outputs)
        rx.wait("a", timeout=3, copy=False)
        with pytest.raises(DuplicateRequest, match="held"):
            rx.expect("a")
        rel = Release()
        tx2 = PushSender(sender_id="enc-rx-other", bootstrap_timeout=3.0)
        try:  # an Offer for the held name is refused, not written over it
            d = {"mode": "push", "backend": "tcp", "room": "a", "targets": [rx.target()]}
            tx2.open(d, "q", items).deliver(outputs, rel)
            assert rel.wait(3) and tx2.status("a", rx.endpoint)["code"] == Cancelled.code
            # tx2's Complete for the refused Offer must leave no record: arriving after the
            # release below (a loaded CPU delays it), one would refuse the name's next room.
            # A later room on the same connection proves tx2's Complete has been handled.
            assert_same(send_and_wait(tx2, rx, "after-refusal", items, outputs), outputs, items)
            assert rx.stats["late_complete"] == 1
        finally:
            tx2.close()
        rx.release("a")
        assert_same(send_and_wait(tx, rx, "a", items, outputs), outputs, items)


def test_a_refused_senders_complete_after_the_release_leaves_no_record(tx):
    """The order a loaded CPU can produce: a held room's name is refused to another sender,
    the room is released, and only then does that sender's Complete arrive. It must not
    leave a failed record that refuses the name's next room (driven through the I/O
    handlers in that order)."""
    from epd_encoder.transfer import messages as m

    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        items, outputs = make_room(1)
        send(tx, rx, "a", items, outputs)
        rx.wait("a", timeout=3, copy=False)
        other = b"another-sender"
        offer = m.Offer(room="a", request_id="q", sender="enc-other", items=tuple(items), total_bytes=0)
        with rx._lock:
            rx._on_offer(other, offer)  # refused: the name is held
        rx.release("a")
        with rx._lock:
            rx._on_complete(other, m.Complete(room="a", ok=False, code=Cancelled.code, reason="refused"))
            assert rx._orphans.get("a") is None
        assert_same(send_and_wait(tx, rx, "a", items, outputs), outputs, items)


def send_and_wait(tx, rx, room, items, outputs):
    send(tx, rx, room, items, outputs)
    return rx.wait(room, timeout=3)


def test_close_releases_held_rooms_and_their_views_stay_readable(tx):
    rx = EmbeddingReceiver("tcp", pool_bytes=1 << 20)
    items, outputs = make_room(1, tokens=8, hidden=16)
    send(tx, rx, "a", items, outputs)
    got = rx.wait("a", timeout=3, copy=False)
    pool = rx.plane.pool
    rx.close()
    assert pool.used_bytes == 0 and rx.held_rooms() == []
    assert_same(got, outputs, items)
    assert rx.release("a") is False


def test_discard_releases_a_held_room(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        items, outputs = make_room(1)
        send(tx, rx, "a", items, outputs)
        rx.wait("a", timeout=3, copy=False)
        rx.discard("a")
        assert rx.held_rooms() == [] and rx.plane.pool.used_bytes == 0


def test_a_non_cpu_device_copies_even_when_asked_not_to(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, device="meta") as rx:
        items, outputs = make_room(1, tokens=8, hidden=16)
        send(tx, rx, "a", items, outputs)
        got = rx.wait("a", timeout=3, copy=False)
        assert got[0].embedding.device.type == "meta" and got[0].embedding.shape == (8, 16)
        assert rx.held_rooms() == [] and rx.plane.pool.used_bytes == 0


def test_an_offer_from_another_request_replaces_an_unclaimed_done_room(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        old_items, old_outputs = make_room(1, seed=1)
        items, outputs = make_room(1, seed=2)
        send(tx, rx, "a", old_items, old_outputs)
        assert wait_for(lambda: rx.poll("a") == "done")
        rel = Release()  # not registered again: a delivery built from the target alone
        d = {"mode": "push", "backend": "tcp", "room": "a", "targets": [rx.target()]}
        tx.open(d, "q2", items).deliver(outputs, rel)
        assert rel.wait(5) and tx.status("a", rx.endpoint)["state"] == "done"
        assert_same(rx.wait("a", timeout=3), outputs, items)
        assert rx.plane.pool.used_bytes == 0  # the unclaimed room's region went with it


def test_delivery_of_a_name_that_ended_here_starts_a_new_room(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        items, outputs = make_room(1, seed=3)
        tx.open(rx.delivery("f"), "f", items).fail(EncodeFailed("tower fell over"))
        assert wait_for(lambda: rx.poll("f") == "failed")
        send(tx, rx, "done-unclaimed", items, outputs)
        assert wait_for(lambda: rx.poll("done-unclaimed") == "done")
        for room in ("f", "done-unclaimed"):
            rx.delivery(room)  # drops the ended room: nothing answers for the name until the new one
            assert rx.poll(room) == "pending"
        assert rx.plane.pool.used_bytes == 0
        send(tx, rx, "f", items, outputs)
        assert_same(rx.wait("f", timeout=3), outputs, items)


def test_a_repeated_offer_of_an_ended_room_is_refused():
    """The same request's Offer again (same sender, same request id) is not a new room; nor is
    the first Offer after a room failed here before any Offer (likely that request's, late)."""
    from epd_encoder.transfer import messages as m

    with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as rx:
        items, _ = make_room(1)
        offer = m.Offer(room="a", request_id="q", sender="enc", items=tuple(items), total_bytes=layout(items)[1])
        with rx._lock:
            rx._on_offer(b"enc", offer)
            rx._fail(rx._live["a"], Cancelled("gave up"))
            rx._on_offer(b"enc", offer)
            assert "a" not in rx._live and rx._refused.get(("a", b"enc"))
            rx._on_offer(b"enc", m.Offer(room="a", request_id="q-next", sender="enc", items=tuple(items),
                                         total_bytes=layout(items)[1]))
            assert "a" in rx._live  # another request of the same sender: a new room
        rx.expect("timed-out", timeout=0.05)
        assert wait_for(lambda: rx.poll("timed-out") == "failed")
        with rx._lock:
            rx._on_offer(b"enc", m.Offer(room="timed-out", request_id="q", sender="enc", items=tuple(items),
                                         total_bytes=layout(items)[1]))
            assert "timed-out" not in rx._live
