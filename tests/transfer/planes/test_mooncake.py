# SPDX-License-Identifier: Apache-2.0
import sys
import threading

import pytest
import torch

from epd_encoder.errors import ConfigError, EncodeFailed, InvalidInput
from epd_encoder.transfer import base
from epd_encoder.transfer.planes import mooncake
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.messages import WireItem, layout

MiB = 1 << 20
_SKIP = "mooncake not installed (pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)"


def _require_mooncake():
    pytest.importorskip("mooncake.engine", reason=_SKIP)


@pytest.fixture(scope="module")
def pair():
    _require_mooncake()
    rx = mooncake.MooncakeReceiverPlane(8 * MiB)
    tx = mooncake.MooncakeSenderPlane()
    yield rx, tx
    tx.close()
    rx.close()


def _no_frames(frames):
    raise AssertionError("the mooncake plane must write out of band, not send frames")


def _room(items, seed):
    """Tensors for ``items`` in layout order, and the ``(offset, tensor)`` chunks to send."""
    offsets, total = layout(items)
    g = torch.Generator().manual_seed(seed)
    tensors, chunks = [], []
    for item, per in zip(items, offsets):
        dtype = getattr(torch, item.dtype)
        for off, nbytes in per:
            t = torch.randn(item.num_tokens, item.hidden_size, generator=g).to(dtype)
            assert t.numel() * t.element_size() == nbytes
            tensors.append(t)
            chunks.append((off, t))
    return tensors, chunks, total


def _received(rx, region, items):
    view = rx.view(region)
    offsets, _ = layout(items)
    out = []
    for item, per in zip(items, offsets):
        for off, nbytes in per:
            raw = view[off:off + nbytes].clone()
            out.append(raw.view(getattr(torch, item.dtype)).view(item.num_tokens, item.hidden_size))
    return out


def _send(rx, tx, items, seed):
    tensors, chunks, total = _room(items, seed)
    region = rx.allocate(total)
    tx.write(rx.info(), rx.destination(region), chunks, _no_frames)
    return region, tensors


# --- real Mooncake tcp on loopback ------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_multi_tensor_layout(pair, dtype):
    rx, tx = pair
    items = (WireItem("a", 7, (1, 14, 2), 24, dtype, num_deepstack=2),
             WireItem("b", 3, (1, 2, 6), 24, dtype),
             WireItem("c", 33, (1, 6, 22), 24, dtype, num_deepstack=1))
    region, tensors = _send(rx, tx, items, seed=1)
    try:
        got = _received(rx, region, items)
        assert len(got) == len(tensors) == 6
        for want, have in zip(tensors, got):
            assert have.dtype == want.dtype
            assert torch.equal(have.view(torch.int16 if dtype == "bfloat16" else torch.int32),
                               want.view(torch.int16 if dtype == "bfloat16" else torch.int32))
    finally:
        rx.free(region)


@pytest.mark.timeout(60)
def test_out_of_order_and_strided_chunks_land_at_their_offsets(pair):
    rx, tx = pair
    a = torch.arange(48, dtype=torch.float32).view(6, 8).t()  # non-contiguous
    b = torch.arange(100, 116, dtype=torch.bfloat16)
    region = rx.allocate(4096)
    try:
        rx.view(region).zero_()
        tx.write(rx.info(), rx.destination(region), [(1024, b), (0, a)], _no_frames)
        got = rx.view(region)
        assert torch.equal(got[:192].clone().view(torch.float32).view(8, 6), a)
        assert torch.equal(got[1024:1056].clone().view(torch.bfloat16), b)
        assert int(got[192:1024].count_nonzero()) == 0  # a gap wider than padding is not written
        assert int(got[1056:].count_nonzero()) == 0
    finally:
        rx.free(region)


@pytest.mark.timeout(60)
def test_info_and_destination_describe_one_registered_buffer(pair):
    rx, _ = pair
    info = rx.info()
    host, _, port = info["session"].rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert info["size"] == 8 * MiB
    a, b = rx.allocate(1000), rx.allocate(5000)
    try:
        da, db = rx.destination(a), rx.destination(b)
        assert da == {"addr": info["base"] + a.offset, "nbytes": 1000}
        assert db["addr"] - da["addr"] == b.offset - a.offset
        assert info["base"] <= da["addr"] and db["addr"] + db["nbytes"] <= info["base"] + info["size"]
        assert rx.view(b).data_ptr() == db["addr"]
    finally:
        rx.free(a)
        rx.free(b)


@pytest.mark.timeout(60)
def test_concurrent_rooms_share_the_buffer(pair):
    rx, tx = pair
    rooms = [(WireItem(f"k{i}", 5 + 9 * i, (1, 1, 1), 32, "float32", num_deepstack=i % 2),) for i in range(6)]
    results, errors = {}, []

    def one(i):
        try:
            results[i] = _send(rx, tx, rooms[i], seed=100 + i)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(rooms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == len(rooms)
    spans = sorted((r.offset, r.offset + r.nbytes) for r, _ in results.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    for i, (region, tensors) in results.items():
        for want, have in zip(tensors, _received(rx, region, rooms[i])):
            assert torch.equal(want, have)
        rx.free(region)


@pytest.mark.timeout(60)
def test_staging_grows_for_a_larger_room(pair):
    rx, tx = pair
    small = (WireItem("s", 4, (1, 2, 2), 16, "float32"),)
    big = (WireItem("b", 768, (1, 24, 32), 1024, "float32", num_deepstack=1),)  # 6 MiB > 1 MiB staging
    for items, seed in ((small, 3), (big, 4), (small, 5)):
        region, tensors = _send(rx, tx, items, seed)
        for want, have in zip(tensors, _received(rx, region, items)):
            assert torch.equal(want, have)
        rx.free(region)


@pytest.mark.timeout(60)
def test_oversized_write_is_refused_before_any_byte_moves(pair):
    rx, tx = pair
    region = rx.allocate(256)
    try:
        rx.view(region).fill_(0xAB)
        dest = rx.destination(region)
        too_long = [(0, torch.zeros(65, dtype=torch.float32))]  # 260 bytes into 256
        with pytest.raises(EncodeFailed, match="refusing"):
            tx.write(rx.info(), dest, too_long, _no_frames)
        with pytest.raises(EncodeFailed, match="refusing"):
            tx.write(rx.info(), dest, [(0, torch.zeros(4)), (-4, torch.zeros(1))], _no_frames)
        outside = {"addr": rx.info()["base"] + rx.info()["size"] - 64, "nbytes": 256}
        with pytest.raises(EncodeFailed, match="outside"):
            tx.write(rx.info(), outside, [(0, torch.zeros(4))], _no_frames)
        with pytest.raises(EncodeFailed, match="malformed"):
            tx.write(rx.info(), {"addr": dest["addr"]}, [(0, torch.zeros(4))], _no_frames)
        assert bool((rx.view(region) == 0xAB).all())
    finally:
        rx.free(region)


@pytest.mark.timeout(60)
def test_write_to_a_closed_receiver_fails_typed_and_bounded():
    _require_mooncake()
    rx = mooncake.MooncakeReceiverPlane(1 * MiB)
    tx = mooncake.MooncakeSenderPlane()
    try:
        region = rx.allocate(4096)
        info, dest = rx.info(), rx.destination(region)
        tx.write(info, dest, [(0, torch.ones(16))], _no_frames)  # the session is up
        rx.close()
        outcome = []

        def attempt():
            try:
                tx.write(info, dest, [(0, torch.ones(16))], _no_frames)
                outcome.append(None)
            except Exception as e:
                outcome.append(e)

        t = threading.Thread(target=attempt, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "a write to a closed receiver must fail, not hang"
        assert isinstance(outcome[0], EncodeFailed) and "returned" in str(outcome[0])
    finally:
        tx.close()
        rx.close()
    with pytest.raises(EncodeFailed, match="closed"):
        tx.write(info, dest, [(0, torch.ones(1))], _no_frames)


@pytest.mark.timeout(60)
def test_registry_builds_the_mooncake_pair():
    _require_mooncake()
    rx = base.receiver_plane("mooncake", pool_bytes=MiB)
    tx = base.sender_plane("mooncake")
    try:
        assert isinstance(rx, base.ReceiverPlane) and isinstance(tx, base.SenderPlane)
        assert rx.name == tx.name == "mooncake"
    finally:
        tx.close()
        rx.close()


# --- without Mooncake: fakes --------------------------------------------------------------

class _FakeEngine:
    def __init__(self, register_rc=0):
        self.registered, self.unregistered = [], []
        self.register_rc = register_rc

    def register_memory(self, ptr, n):
        self.registered.append((ptr, n))
        return self.register_rc

    def unregister_memory(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_construction_without_mooncake_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    for build in (lambda: mooncake.MooncakeReceiverPlane(MiB), mooncake.MooncakeSenderPlane):
        with pytest.raises(ConfigError, match="mooncake-transfer-engine") as info:
            build()
        assert isinstance(info.value.__cause__, ImportError)


def test_receiver_registers_once_and_unregisters_on_close(monkeypatch):
    fake = _FakeEngine()
    monkeypatch.setattr(mooncake, "_engine", lambda *a: (fake, "127.0.0.1:1"))
    rx = mooncake.MooncakeReceiverPlane(64 * 1024)
    regions = [rx.allocate(1000) for _ in range(20)]
    for r in regions:
        rx.free(r)
    regions = [rx.allocate(3000) for _ in range(10)]
    assert fake.registered == [(rx.info()["base"], 64 * 1024)]
    assert rx.in_band is False and rx.capacity == 64 * 1024
    rx.free(regions[0], failed=True)  # a late one-sided write may still land there
    assert rx.pool.quarantined_bytes > 0
    assert all(rx.allocate(3000).offset != regions[0].offset for _ in range(5))
    rx.close()
    rx.close()
    assert fake.unregistered == [rx.info()["base"]]
    with pytest.raises(ConfigError):
        rx.allocate(10)


def test_write_frame_copies_inside_the_region_only(monkeypatch):
    monkeypatch.setattr(mooncake, "_engine", lambda *a: (_FakeEngine(), "127.0.0.1:1"))
    rx = mooncake.MooncakeReceiverPlane(4096)
    region = rx.allocate(128)
    rx.write_frame(region, 64, memoryview(bytes(range(64))))
    assert rx.view(region)[64:].tolist() == list(range(64))
    with pytest.raises(InvalidInput):
        rx.write_frame(region, 100, memoryview(bytes(64)))
    with pytest.raises(InvalidInput):
        rx.view(Region(4000, 200))


def test_staging_reuses_then_regrows_in_powers_of_two():
    fake = _FakeEngine()
    staging = mooncake._Staging(fake, pin_memory=False)
    a = staging.acquire(1000)
    assert a.numel() == MiB
    staging.release(a)
    assert staging.acquire(MiB) is a and len(fake.registered) == 1
    b = staging.acquire(10)  # a is busy: a second buffer for a concurrent write
    assert b is not a and len(fake.registered) == 2
    staging.release(a)
    staging.release(b)
    c = staging.acquire(3 * MiB)
    assert c.numel() == 4 * MiB
    assert fake.unregistered == [a.data_ptr()] or fake.unregistered == [b.data_ptr()]
    staging.close()
    assert len(fake.unregistered) == 3
    with pytest.raises(EncodeFailed, match="closed"):
        staging.acquire(10)


def test_registration_failures_are_typed(monkeypatch):
    monkeypatch.setattr(mooncake, "_engine", lambda *a: (_FakeEngine(register_rc=-1), "127.0.0.1:1"))
    with pytest.raises(ConfigError, match="register_memory"):
        mooncake.MooncakeReceiverPlane(4096)
    with pytest.raises(EncodeFailed, match="register_memory"):
        mooncake._Staging(_FakeEngine(register_rc=-1), pin_memory=False).acquire(10)


# --- end to end: EmbeddingReceiver + PushSender over the mooncake plane --------------------

def _outputs(items, seed):
    g = torch.Generator().manual_seed(seed)
    from epd_encoder.types import ItemOutput

    def t(item):
        return torch.randn(item.num_tokens, item.hidden_size, generator=g).to(getattr(torch, item.dtype))

    return [ItemOutput(t(it), tuple(t(it) for _ in range(it.num_deepstack)) or None) for it in items]


@pytest.mark.timeout(60)
def test_push_end_to_end_over_mooncake_with_two_tp_ranks():
    _require_mooncake()
    from epd_encoder.transfer.receiver import EmbeddingReceiver
    from epd_encoder.transfer.sender import PushSender

    items = [WireItem("img-a", 12, (1, 6, 8), 40, "bfloat16", num_deepstack=2),
             WireItem("img-b", 5, (1, 2, 10), 40, "bfloat16", num_deepstack=2)]
    outputs = _outputs(items, seed=9)
    released = threading.Event()
    done = []
    with EmbeddingReceiver("mooncake", pool_bytes=MiB, tp_rank=0, tp_size=2) as r0, \
            EmbeddingReceiver("mooncake", pool_bytes=MiB, tp_rank=1, tp_size=2) as r1:
        r1.expect("room-1")
        delivery = r0.delivery("room-1", peers=[r1.target()], items=items)
        assert delivery["backend"] == "mooncake"
        assert {t["info"]["session"] for t in delivery["targets"]} == {r0.plane.info()["session"],
                                                                     r1.plane.info()["session"]}
        sender = PushSender(sender_id="enc-0")
        try:
            handle = sender.open(delivery, "req-1", items, on_done=done.append)
            handle.deliver(outputs, released.set)
            for rx in (r0, r1):
                got = rx.wait("room-1", timeout=20)
                assert [g.key for g in got] == ["img-a", "img-b"]
                for g, want in zip(got, outputs):
                    assert torch.equal(g.embedding, want.embedding)
                    assert len(g.deepstack) == 2
                    for a, b in zip(g.deepstack, want.deepstack):
                        assert torch.equal(a, b)
            assert released.wait(10)
        finally:
            sender.close()
        assert done and done[0]["state"] == "done"
        assert r0.plane.pool.used_bytes == 0 and r1.plane.pool.used_bytes == 0


@pytest.mark.timeout(60)
def test_push_end_to_end_failed_write_fails_the_room_on_both_sides():
    _require_mooncake()
    from epd_encoder.transfer.receiver import EmbeddingReceiver
    from epd_encoder.transfer.sender import PushSender

    items = [WireItem("img", 8, (1, 4, 8), 32, "float32")]
    with EmbeddingReceiver("mooncake", pool_bytes=MiB) as rx:
        # The control plane stays up while the registered memory goes: every one-sided write is refused.
        rx.plane._engine.unregister_memory(rx.plane.info()["base"])
        delivery = rx.delivery("room-x", items=items)
        sender = PushSender(sender_id="enc-1")
        try:
            done = []
            handle = sender.open(delivery, "req-x", items, on_done=done.append)
            handle.deliver(_outputs(items, 1), lambda: None)
            with pytest.raises(EncodeFailed, match="returned"):
                rx.wait("room-x", timeout=20)
            assert done and done[0]["state"] == "failed" and done[0]["code"] == EncodeFailed.code
        finally:
            sender.close()
