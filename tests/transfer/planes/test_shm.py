# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import os
import threading

import pytest
import torch

from epd_encoder.errors import ConfigError, EncodeFailed, InvalidInput, Overloaded
from epd_encoder.transfer.base import ReceiverPlane, Region, SenderPlane, receiver_plane, sender_plane
from epd_encoder.transfer.messages import layout
from epd_encoder.transfer.receiver import EmbeddingReceiver
from epd_encoder.transfer.sender import PushSender
from epd_encoder.transfer.planes.shm import PREFIX, ShmReceiverPlane, ShmSenderPlane
from epd_encoder.types import ItemOutput

from tests.transfer.shm_helpers import SHM, items_and_tensors

pytestmark = pytest.mark.usefixtures("nothing_left_behind")


def test_planes_satisfy_protocols_through_registry():
    r, s = receiver_plane("shm", pool_bytes=4096), sender_plane("shm")
    try:
        assert isinstance(r, ReceiverPlane) and isinstance(s, SenderPlane)
        assert isinstance(r, ShmReceiverPlane) and r.in_band is False
    finally:
        r.close()
        s.close()


def test_info_names_a_pid_tagged_segment_of_the_pool_size(rx):
    info = rx.info()
    assert info["segment"].startswith(f"{PREFIX}{os.getpid()}-")
    assert info["size"] == 1 << 20 and info["host"] and info["boot_id"]
    st = os.stat(os.path.join(SHM, info["segment"]))
    assert st.st_size == 1 << 20 and st.st_ino == info["inode"]
    assert st.st_blocks * 512 >= 1 << 20  # reserved up front, not sparse
    assert rx.destination(Region(128, 64)) == {"offset": 128, "nbytes": 64}


@pytest.mark.parametrize("dtype,deepstack", [(torch.float32, 0), (torch.bfloat16, 3)])
def test_written_tensors_read_back_exactly_at_layout_offsets(rx, tx, dtype, deepstack):
    items, tensors = items_and_tensors(dtype, deepstack)
    offsets, total = layout(items)
    rx.allocate(100)  # the room's region does not start at 0
    region = rx.allocate(total)
    chunks = [(off, t) for per, ts in zip(offsets, tensors) for (off, _), t in zip(per, ts)]
    tx.write(rx.info(), rx.destination(region), chunks, lambda frames: pytest.fail("shm sends no frames"))
    view = rx.view(region)
    assert view.dtype == torch.uint8 and view.numel() == total
    for per, ts in zip(offsets, tensors):
        for (off, n), t in zip(per, ts):
            got = view[off:off + n].view(dtype).reshape(t.shape)
            assert torch.equal(got, t)


def test_view_is_zero_copy_over_the_segment(rx, tx):
    region = rx.allocate(256)
    view = rx.view(region)
    tx.write(rx.info(), rx.destination(region), [(64, torch.full((16,), 7, dtype=torch.uint8))], None)
    assert view[64:80].tolist() == [7] * 16 and view[:64].sum() == 0
    view[0] = 9
    assert rx.view(region)[0] == 9


def test_non_contiguous_tensor_is_written_in_logical_order(rx, tx):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    region = rx.allocate(t.numel() * 4)
    tx.write(rx.info(), rx.destination(region), [(0, t)], None)
    assert torch.equal(rx.view(region).view(torch.float32).reshape(4, 3), t)


@pytest.mark.parametrize("dest_fn,chunk_off", [
    (lambda r, size: {"offset": size - 64, "nbytes": 128}, 0),  # past the segment end
    (lambda r, size: {"offset": r.offset, "nbytes": r.nbytes}, 200),  # past the region end
    (lambda r, size: {"offset": r.offset, "nbytes": r.nbytes}, -8),
    (lambda r, size: {"offset": -64, "nbytes": 64}, 0),
    (lambda r, size: {"offset": "0", "nbytes": 64}, 0),
    (lambda r, size: {"nbytes": 64}, 0),
])
def test_out_of_bounds_destination_is_refused_and_writes_nothing(rx, tx, dest_fn, chunk_off):
    region = rx.allocate(256)
    dest = dest_fn(region, rx.info()["size"])
    # The first chunk is valid: validation must reject the room before any byte lands.
    chunks = [(0, torch.ones(16, dtype=torch.uint8)), (chunk_off, torch.ones(64, dtype=torch.uint8))]
    with pytest.raises(EncodeFailed):
        tx.write(rx.info(), dest, chunks, None)
    assert rx.view(Region(0, rx.info()["size"])).count_nonzero() == 0


def test_sender_refuses_other_hosts_replaced_and_missing_segments(rx, tx):
    region = rx.allocate(64)
    dest, chunk = rx.destination(region), [(0, torch.ones(8))]
    with pytest.raises(ConfigError, match="tcp backend"):
        tx.write({**rx.info(), "boot_id": "another-machine"}, dest, chunk, None)
    with pytest.raises(ConfigError, match="inode"):
        tx.write({**rx.info(), "inode": rx.info()["inode"] + 1}, dest, chunk, None)
    with pytest.raises(EncodeFailed):
        tx.write({**rx.info(), "segment": "../../etc/passwd"}, dest, chunk, None)
    with pytest.raises(EncodeFailed, match="does not exist"):
        tx.write({**rx.info(), "segment": f"{PREFIX}1-0000"}, dest, chunk, None)
    assert rx.view(region).count_nonzero() == 0


def test_sender_caches_one_mapping_and_drops_it_when_the_segment_goes(tx):
    a, b = ShmReceiverPlane(pool_bytes=4096), ShmReceiverPlane(pool_bytes=4096)
    try:
        for plane in (a, a, b):
            r = plane.allocate(64)
            tx.write(plane.info(), plane.destination(r), [(0, torch.ones(4))], None)
        assert set(tx._maps) == {a.segment, b.segment}
        info, dest = a.info(), a.destination(Region(0, 64))
        a.close()
        assert not os.path.exists(a.path)
        with pytest.raises(EncodeFailed, match="does not exist"):
            tx.write(info, dest, [(0, torch.ones(4))], None)
        assert set(tx._maps) == {b.segment}
    finally:
        a.close()
        b.close()


def test_sender_reopens_a_segment_replaced_under_the_same_name(tmp_path, tx):
    sender = ShmSenderPlane(shm_dir=str(tmp_path))
    rx = ShmReceiverPlane(pool_bytes=4096, shm_dir=str(tmp_path))
    try:
        sender.write(rx.info(), rx.destination(Region(0, 64)), [(0, torch.ones(4))], None)
        fresh = tmp_path / "fresh"
        fresh.write_bytes(b"\0" * 8192)
        os.replace(fresh, rx.path)  # same name, new file
        info = {**rx.info(), "inode": os.stat(rx.path).st_ino, "size": 8192}
        sender.write(info, {"offset": 4096, "nbytes": 64}, [(0, torch.full((4,), 2.0))], None)
        data = (tmp_path / rx.segment).read_bytes()
        assert torch.equal(torch.frombuffer(bytearray(data[4096:4112]), dtype=torch.float32),
                           torch.full((4,), 2.0))
    finally:
        sender.close()
        rx.close()


def test_receiver_write_frame_is_bounds_checked(rx):
    region = rx.allocate(128)
    rx.write_frame(region, 64, memoryview(b"\x05" * 64))
    assert rx.view(region)[64:].tolist() == [5] * 64
    with pytest.raises(InvalidInput):
        rx.write_frame(region, 65, memoryview(b"\x05" * 64))
    with pytest.raises(InvalidInput):
        rx.view(Region(rx.info()["size"] - 64, 128))
    assert rx.view(Region(0, rx.info()["size"])).count_nonzero() == 64


def test_pool_full_raises_overloaded_and_free_makes_room(rx):
    big = rx.allocate(rx.capacity)
    with pytest.raises(Overloaded):
        rx.allocate(64)
    rx.free(big)
    assert rx.allocate(rx.capacity) == big


def test_timed_out_region_is_quarantined_so_a_late_write_hits_no_other_room(tx):
    now = [0.0]
    rx = ShmReceiverPlane(pool_bytes=4096, quarantine_s=5.0, clock=lambda: now[0])
    try:
        late = rx.allocate(4096)
        late_dest = rx.destination(late)
        rx.free(late, failed=True)  # the receiver gave up on the room (timeout)
        with pytest.raises(Overloaded):
            rx.allocate(64)
        tx.write(rx.info(), late_dest, [(0, torch.ones(1024))], None)  # the late write
        now[0] = 5.0
        fresh = rx.allocate(4096)
        assert fresh.offset == late.offset  # reusable only once the window has passed
    finally:
        rx.close()


def test_concurrent_writers_into_distinct_regions(rx, tx):
    regions = [rx.allocate(64 << 10) for _ in range(8)]
    info = rx.info()

    def send(i: int) -> None:
        for _ in range(5):
            tx.write(info, rx.destination(regions[i]), [(0, torch.full((16 << 10,), float(i)))], None)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(regions):
        assert torch.equal(rx.view(r).view(torch.float32), torch.full((16 << 10,), float(i)))


@pytest.fixture
def push():
    receiver = EmbeddingReceiver(backend="shm", pool_bytes=1 << 20, quarantine_s=0.0)
    sender = PushSender(sender_id="enc-shm-test", bootstrap_timeout=10.0, transfer_timeout=10.0)
    yield receiver, sender
    sender.close()
    receiver.close()
    assert not os.path.exists(receiver.plane.path)


def test_end_to_end_push_over_shm_delivers_every_tensor(push):
    receiver, sender = push
    items, tensors = items_and_tensors(torch.bfloat16, 2)
    outputs = [ItemOutput(ts[0], tuple(ts[1:])) for ts in tensors]
    released, statuses = [], []
    handle = sender.open(receiver.delivery("room-1", items=items), "req-1", items, on_done=statuses.append)
    handle.deliver(outputs, lambda: released.append(1))
    got = receiver.wait("room-1", timeout=30)
    assert [g.key for g in got] == ["a", "b"] and [g.num_tokens for g in got] == [7, 3]
    for g, ts in zip(got, tensors):
        assert torch.equal(g.embedding, ts[0]) and len(g.deepstack) == 2
        assert all(torch.equal(d, t) for d, t in zip(g.deepstack, ts[1:]))
    assert receiver.plane.pool.used_bytes == 0  # copied out and freed
    for _ in range(200):
        if statuses:
            break
        threading.Event().wait(0.05)
    assert released == [1] and statuses[0]["state"] == "done"


def test_end_to_end_cross_host_target_fails_the_room_on_both_sides(push):
    receiver, sender = push
    items, tensors = items_and_tensors(torch.float32, 0)
    delivery = receiver.delivery("room-x", items=items)
    delivery["targets"][0]["info"]["boot_id"] = "another-machine"
    released = []
    handle = sender.open(delivery, "req-x", items)
    handle.deliver([ItemOutput(ts[0]) for ts in tensors], lambda: released.append(1))
    with pytest.raises(ConfigError, match="tcp backend"):
        receiver.wait("room-x", timeout=30)
    assert sender.status("room-x", receiver.endpoint)["state"] == "failed" and released == [1]
    assert receiver.plane.view(Region(0, receiver.plane.capacity)).count_nonzero() == 0


def test_sender_unmaps_segments_of_receivers_that_left():
    from epd_encoder.transfer.planes.shm import ShmReceiverPlane, ShmSenderPlane

    tx = ShmSenderPlane(max_segments=2)
    data = torch.arange(64, dtype=torch.uint8)
    alive = []
    for _ in range(4):
        rx = ShmReceiverPlane(pool_bytes=4096)
        r = rx.allocate(64)
        tx.write(rx.info(), rx.destination(r), [(0, data)], lambda frames: None)
        assert torch.equal(rx.view(r)[:64], data)
        alive.append(rx)
        if len(alive) == 2:
            alive.pop(0).close()  # a receiver goes away
    assert len(tx._maps) <= 2  # gone segments dropped, the rest bounded
    for rx in alive:
        rx.close()
    tx.close()
