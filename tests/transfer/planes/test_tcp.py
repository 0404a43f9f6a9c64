# SPDX-License-Identifier: Apache-2.0
"""The raw-socket tcp data plane: end to end, hostile data connections, striping, timeouts."""

import socket
import threading
import time

import pytest
import torch

from epd_encoder.errors import EncodeFailed, RequestTimeout, SchemaError
from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer import messages as m
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.sender import PushSender
from epd_encoder.transfer.planes.tcp import HEADER, MAGIC, OK, TcpReceiverPlane, _check_coverage
from epd_encoder.transfer.planes.tcp_sender import TcpSenderPlane, _stripes
from tests.transfer import Release, assert_same, make_item, make_room, wait_for
from tests.transfer.planes.test_inband import RogueSender, offer_and_accept


@pytest.fixture
def rx():
    r = EmbeddingReceiver("tcp", pool_bytes=8 << 20)
    yield r
    r.close()


@pytest.fixture
def tx():
    s = PushSender(sender_id="enc-tcp", bootstrap_timeout=2.0, transfer_timeout=2.0)
    yield s
    s.close()


def roundtrip(rx, tx, room, items, outputs, copy=True):
    rel = Release()
    tx.open(rx.delivery(room), f"req-{room}", items).deliver(outputs, rel)
    got = rx.wait(room, timeout=5, copy=copy)
    assert rel.wait(2) and wait_for(lambda: tx.status(room, rx.endpoint)["state"] == "done")
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n_items,n_ds", [(1, 0), (3, 0), (1, 3), (4, 2)])
def test_rooms_arrive_bit_exact(rx, tx, dtype, n_items, n_ds):
    items, outputs = make_room(n_items, tokens=7, hidden=24, dtype=dtype, n_ds=n_ds)
    assert_same(roundtrip(rx, tx, "room", items, outputs), outputs, items)
    assert rx.plane.pool.used_bytes == 0


def test_zero_byte_items_and_empty_rooms(rx, tx):
    items, outputs = make_room(2, tokens=0, hidden=8, n_ds=1)
    assert_same(roundtrip(rx, tx, "zero", items, outputs), outputs, items)
    assert roundtrip(rx, tx, "empty", [], []) == []


def test_info_advertises_the_data_port():
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, advertise_host="rx.example") as rx:
        info = rx.target()["info"]
        assert info["data_host"] == "rx.example" and info["data_port"] == rx.plane.data_port > 0
        assert info["data_port"] != int(rx.endpoint.rsplit(":", 1)[1])


def test_a_large_room_is_striped_over_parallel_connections():
    tx = PushSender(sender_id="enc-stripe", plane_options={"tcp": {"streams": 3, "stripe_min": 1 << 16}})
    try:
        with EmbeddingReceiver("tcp", pool_bytes=8 << 20) as rx:
            pairs = [make_item(0, tokens=300, hidden=1000, n_ds=1), make_item(1, tokens=5, hidden=7)]
            items, outputs = [p[0] for p in pairs], [p[1] for p in pairs]
            for i in range(3):  # connections are reused across rooms
                assert_same(roundtrip(rx, tx, f"big{i}", items, outputs), outputs, items)
            assert rx.plane.stats["connections"] == 3
    finally:
        tx.close()


def test_many_concurrent_rooms(rx, tx):
    rooms = {}
    for i in range(30):
        items, outputs = make_room(2, tokens=16, hidden=32, n_ds=i % 2, seed=i)
        rooms[f"r{i}"] = (items, outputs)
    handles = [tx.open(rx.delivery(r), r, v[0]) for r, v in rooms.items()]
    threads = [threading.Thread(target=h.deliver, args=(rooms[h.room][1], Release())) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, (items, outputs) in rooms.items():
        assert_same(rx.wait(r, timeout=10), outputs, items)


def test_the_sender_reconnects_after_the_receiver_drops_its_connection(rx, tx):
    items, outputs = make_room(1)
    assert_same(roundtrip(rx, tx, "a", items, outputs), outputs, items)
    for c in list(rx.plane._conns):
        c.shutdown(socket.SHUT_RDWR)
    assert wait_for(lambda: not rx.plane._conns)
    assert_same(roundtrip(rx, tx, "b", items, outputs), outputs, items)
    assert rx.plane.stats["connections"] == 2


def test_the_sender_plane_takes_the_transfer_timeout(tx):
    assert tx._plane("tcp")._timeout == 2.0


# --- hostile data connections ---------------------------------------------------------


@pytest.fixture
def rogue(rx):
    s = RogueSender(rx.endpoint)
    yield s
    s.close()


def data_conn(rx) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", rx.plane.data_port), timeout=3)
    return s


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def written(rogue, room, total):
    rogue.send(m.Written(room=room, total_bytes=total))
    return rogue.recv()


@pytest.mark.parametrize("offset,nbytes", [(64, 128), (0, 129), (1 << 40, 1), (0, 0)])
def test_writes_outside_the_region_close_the_connection_unwritten(rx, rogue, offset, nbytes):
    item, _ = make_item(tokens=4, hidden=8)  # one tensor of 128 B, region of 128 B
    rx.expect("r")
    token = bytes.fromhex(offer_and_accept(rogue, "r", [item]).dest["token"])
    before = rx.plane._buf[: 1 << 20].clone()
    s = data_conn(rx)
    s.sendall(HEADER.pack(MAGIC, token, offset, nbytes) + b"\xab" * min(nbytes, 256))
    assert closed_by_peer(s)
    s.close()
    assert torch.equal(rx.plane._buf[: 1 << 20], before), "a refused write touched the pool"
    ack = written(rogue, "r", 128)
    assert isinstance(ack, m.Ack) and not ack.ok and "refused" in ack.reason
    rogue.send(m.Complete(room="r", ok=False, code="schema_error", reason=ack.reason))
    with pytest.raises(SchemaError, match="refused"):
        rx.wait("r", timeout=3)
    assert wait_for(lambda: rx.plane.pool.used_bytes == 0)


@pytest.mark.parametrize("bad", ["token", "magic"])
def test_a_stray_writer_cannot_land_bytes(rx, rogue, bad):
    item, _ = make_item(tokens=4, hidden=8)
    token = bytes.fromhex(offer_and_accept(rogue, "r", [item]).dest["token"])
    before = rx.plane._buf[: 1 << 20].clone()
    s = data_conn(rx)
    header = HEADER.pack(b"XXXX" if bad == "magic" else MAGIC,
                         token if bad == "magic" else bytes(16), 0, 128)
    s.sendall(header + b"\xcd" * 128)
    assert closed_by_peer(s)
    s.close()
    assert torch.equal(rx.plane._buf[: 1 << 20], before)
    assert rx.plane.stats["refused_writes"] == 1


def test_writes_must_cover_exactly_the_layout(rx, rogue):
    item, out = make_item(tokens=3, hidden=8, n_ds=1)  # two 96-B tensors at 0 and 128
    raw = out.embedding.numpy().tobytes()
    cases = {"half": [(0, 48)], "overlap": [(0, 96), (48, 96), (128, 96)],
             "split": [(0, 48), (48, 48), (128, 96)], "padding": [(0, 96), (96, 32), (128, 96)]}
    reasons = {}
    for name, writes in cases.items():
        token = bytes.fromhex(offer_and_accept(rogue, name, [item]).dest["token"])
        s = data_conn(rx)
        for off, n in writes:
            s.sendall(HEADER.pack(MAGIC, token, off, n) + (raw * 2)[:n])
            assert s.recv(1) == OK
        s.close()
        reasons[name] = written(rogue, name, m.layout([item])[1]).reason
    assert reasons["half"] == "2 tensors never arrived" and "overlap" in reasons["overlap"]
    assert reasons["split"] == ""  # a tensor may come in pieces (parallel streams)
    assert "outside the offered layout" in reasons["padding"]


def test_no_write_lands_after_the_region_is_settled(rx, rogue):
    item, out = make_item(tokens=4, hidden=8)
    token = bytes.fromhex(offer_and_accept(rogue, "r", [item]).dest["token"])
    raw = out.embedding.numpy().tobytes()
    s = data_conn(rx)
    s.sendall(HEADER.pack(MAGIC, token, 0, 128) + raw)
    assert s.recv(1) == OK
    assert written(rogue, "r", 128).ok
    s.sendall(HEADER.pack(MAGIC, token, 0, 128) + b"\xee" * 128)
    assert closed_by_peer(s)
    s.close()
    rogue.send(m.Complete(room="r", ok=True))
    got = rx.wait("r", timeout=3, copy=False)
    assert torch.equal(got[0].embedding, out.embedding)
    rx.release("r")


def test_a_region_freed_mid_write_is_not_reused_until_the_write_ends(rx, rogue, tx):
    item, _ = make_item(tokens=64, hidden=64)  # 16 KiB
    token = bytes.fromhex(offer_and_accept(rogue, "r", [item]).dest["token"])
    s = data_conn(rx)
    s.sendall(HEADER.pack(MAGIC, token, 0, 16384) + b"\x01" * 1000)  # the rest never comes
    assert wait_for(lambda: any(sl.writing for sl in rx.plane._slots.values()))
    rx.discard("r")
    assert rx.plane.pool.used_bytes == 16384, "freed while a recv_into could still land in it"
    # A whole room through the same receiver (its I/O and data threads) changes nothing.
    items, outputs = make_room(1, tokens=8, hidden=16)
    assert_same(roundtrip(rx, tx, "other", items, outputs), outputs, items)
    assert rx.plane.pool.used_bytes == 16384, "freed while a recv_into could still land in it"
    s.close()
    assert wait_for(lambda: rx.plane.pool.used_bytes == 0)


# --- the sender plane against broken receivers ------------------------------------------


def test_a_receiver_that_never_acks_times_the_write_out():
    lst = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(lst.accept()), daemon=True).start()
    plane = TcpSenderPlane(timeout=0.3)
    try:
        info = {"data_host": "127.0.0.1", "data_port": lst.getsockname()[1]}
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout, match="stalled"):
            plane.write(info, {"token": "00" * 16, "nbytes": 64}, [(0, torch.ones(16))], None)
        assert time.monotonic() - t0 < 2.0
    finally:
        plane.close()
        lst.close()


def test_no_data_port_and_malformed_destinations_fail_cleanly():
    plane = TcpSenderPlane()
    try:
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
        dead.close()
        with pytest.raises(EncodeFailed, match="cannot connect"):
            plane.write({"data_host": "127.0.0.1", "data_port": port}, {"token": "00" * 16, "nbytes": 64},
                        [(0, torch.ones(16))], None)
        with pytest.raises(EncodeFailed, match="no tcp data port"):
            plane.write({}, {"token": "00" * 16, "nbytes": 64}, [(0, torch.ones(16))], None)
        with pytest.raises(EncodeFailed, match="overflow"):
            plane.write({"data_host": "127.0.0.1", "data_port": port}, {"token": "00" * 16, "nbytes": 32},
                        [(0, torch.ones(16))], None)
    finally:
        plane.close()


# --- pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes,n", [([10_000_000], 2), ([3_000_000, 64, 5_000_000], 3), ([100, 200], 4)])
def test_stripes_cover_the_pieces_exactly_with_page_aligned_cuts(sizes, n):
    pieces, off = [], 0
    for size in sizes:
        pieces.append((off, memoryview(bytearray(size))))
        off += (size + 63) // 64 * 64
    total = sum(sizes)
    stripes = _stripes(pieces, total, n)
    assert 1 <= len(stripes) <= n
    flat = sorted((o, v.nbytes) for s in stripes for o, v in s)
    assert _check_coverage(flat, [(o, v.nbytes) for o, v in pieces]) == ""
    originals = {o for o, _ in pieces}
    assert all(o in originals or o % 4096 == 0 for o, _ in flat)
    if total > n * 4096 * 4:
        assert len(stripes) == n and max(sum(v.nbytes for _, v in s) for s in stripes) < total / n + 8192


def test_coverage_check():
    want = [(0, 128), (128, 64)]
    assert _check_coverage([(0, 192)], want) == ""
    assert _check_coverage([(0, 128)], want) == "1 tensors never arrived"
    assert "overlap" in _check_coverage([(0, 128), (100, 92)], want)
    assert "outside" in _check_coverage([(0, 192), (200, 8)], want)


def test_free_of_a_region_without_writes_and_close_are_clean():
    plane = TcpReceiverPlane(1 << 20)
    region = plane.allocate(4096)
    plane.destination(region)
    assert plane.settle(region, [(0, 4096)]) == "1 tensors never arrived"
    plane.free(region, failed=True)
    assert plane.pool.used_bytes == 0 and plane.settle(Region(0, 0), []) == ""
    plane.close()
    plane.close()


def test_close_joins_the_data_connection_threads():
    # A conn thread left running at interpreter exit is killed while it drops its view of the
    # pool (a torch tensor): libstdc++ aborts the process ("terminate called without ...").
    for _ in range(10):  # each thread ends soon after close() wakes it: a lone try can miss the leak
        plane = TcpReceiverPlane(1 << 20)
        conns = [socket.create_connection(("127.0.0.1", plane.data_port), timeout=3) for _ in range(3)]
        name = f"epd-rx-data-{plane.data_port}-conn"
        assert wait_for(lambda: sum(t.name == name for t in threading.enumerate()) == 3)
        plane.close()
        assert [t.name for t in threading.enumerate() if t.name == name] == []
        for c in conns:
            c.close()
