# SPDX-License-Identifier: Apache-2.0
import base64
import functools
import itertools
import threading
import time

import pytest
import torch

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.transfer import base
from epd_encoder.transfer.planes import nixl
from epd_encoder.transfer.messages import WireItem, layout

MiB = 1 << 20
_ENTRY = ("epd_encoder.transfer.planes.nixl:NixlReceiverPlane", "epd_encoder.transfer.planes.nixl:NixlSenderPlane")


@functools.cache
def _unavailable() -> str:
    """Why real NIXL cannot run here ("" when it can): not importable, or UCX does not start."""
    try:
        nixl._Agent("epd-probe", progress_thread=False, progress_delay_us=1000, ucx_tls="tcp", ucx_devices=None)
    except ConfigError as e:
        return f"nixl unavailable: {e}"
    return ""


def _require_nixl():
    if _unavailable():
        pytest.skip(_unavailable())


@pytest.fixture(scope="module")
def pair():
    _require_nixl()
    rx = nixl.NixlReceiverPlane(8 * MiB)
    tx = nixl.NixlSenderPlane(timeout=10)
    yield rx, tx
    tx.close()
    rx.close()


def _no_frames(frames):
    raise AssertionError("the nixl plane must write out of band, not send frames")


def _room(items, seed):
    """Tensors for ``items`` in layout order, and the ``(offset, tensor)`` chunks to send."""
    offsets, total = layout(items)
    g = torch.Generator().manual_seed(seed)
    tensors, chunks = [], []
    for item, per in zip(items, offsets):
        for off, nbytes in per:
            t = torch.randn(item.num_tokens, item.hidden_size, generator=g).to(getattr(torch, item.dtype))
            assert t.numel() * t.element_size() == nbytes
            tensors.append(t)
            chunks.append((off, t))
    return tensors, chunks, total


def _received(rx, region, items):
    view = rx.view(region)
    out = []
    for item, per in zip(items, layout(items)[0]):
        for off, nbytes in per:
            raw = view[off:off + nbytes].clone()
            out.append(raw.view(getattr(torch, item.dtype)).view(item.num_tokens, item.hidden_size))
    return out


def _send(rx, tx, items, seed):
    tensors, chunks, total = _room(items, seed)
    region = rx.allocate(total)
    tx.write(rx.info(), rx.destination(region), chunks, _no_frames)
    return region, tensors


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


# --- real NIXL (UCX over tcp) on loopback ---------------------------------------------------

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
            assert have.dtype == want.dtype and torch.equal(_bits(have), _bits(want))
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
    assert info["agent"].startswith("epd-rx-") and info["size"] == 8 * MiB
    assert len(base64.b64decode(info["metadata"], validate=True)) > 0
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
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
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
        info, dest = rx.info(), rx.destination(region)
        with pytest.raises(EncodeFailed, match="refusing"):
            tx.write(info, dest, [(0, torch.zeros(65, dtype=torch.float32))], _no_frames)  # 260 B into 256
        with pytest.raises(EncodeFailed, match="refusing"):
            tx.write(info, dest, [(0, torch.zeros(4)), (-4, torch.zeros(1))], _no_frames)
        outside = {"addr": info["base"] + info["size"] - 64, "nbytes": 256}
        with pytest.raises(EncodeFailed, match="outside"):
            tx.write(info, outside, [(0, torch.zeros(4))], _no_frames)
        with pytest.raises(EncodeFailed, match="malformed"):
            tx.write(info, {"addr": dest["addr"]}, [(0, torch.zeros(4))], _no_frames)
        # A peer that lies about its buffer size is still refused by NIXL: the bytes stay unwritten.
        lying = {**info, "size": info["size"] + MiB}
        beyond = {"addr": info["base"] + info["size"], "nbytes": 64}
        with pytest.raises(EncodeFailed, match="refused"):
            tx.write(lying, beyond, [(0, torch.zeros(16))], _no_frames)
        assert bool((rx.view(region) == 0xAB).all())
        tx.write(info, dest, [(0, torch.ones(4))], _no_frames)  # the peer is usable again afterwards
        assert torch.equal(rx.view(region)[:16].clone().view(torch.float32), torch.ones(4))
    finally:
        rx.free(region)


@pytest.mark.timeout(60)
def test_write_to_a_closed_receiver_fails_typed_and_bounded():
    _require_nixl()
    rx = nixl.NixlReceiverPlane(1 * MiB)
    tx = nixl.NixlSenderPlane(timeout=10)
    try:
        region = rx.allocate(4096)
        info, dest = rx.info(), rx.destination(region)
        tx.write(info, dest, [(0, torch.ones(16))], _no_frames)  # connected and cached
        rx.close()
        for _ in range(2):  # once on the cached connection, once reloading the metadata of a dead agent
            outcome = []

            def attempt(outcome=outcome):
                try:
                    tx.write(info, dest, [(0, torch.ones(16))], _no_frames)
                    outcome.append(None)
                except Exception as e:
                    outcome.append(e)

            t = threading.Thread(target=attempt, daemon=True)
            start = time.monotonic()
            t.start()
            t.join(20)
            assert not t.is_alive(), "a write to a closed receiver must fail, not hang"
            assert time.monotonic() - start < 12
            assert isinstance(outcome[0], EncodeFailed), outcome
    finally:
        tx.close()
        rx.close()
    with pytest.raises(EncodeFailed, match="closed"):
        tx.write(info, dest, [(0, torch.ones(1))], _no_frames)


@pytest.mark.timeout(60)
def test_registry_entry_builds_the_nixl_pair(monkeypatch):
    _require_nixl()
    monkeypatch.setitem(base._BACKENDS, "nixl", _ENTRY)
    rx = base.receiver_plane("nixl", pool_bytes=MiB)
    tx = base.sender_plane("nixl", timeout=5.0)
    try:
        assert isinstance(rx, base.ReceiverPlane) and isinstance(tx, base.SenderPlane)
        assert rx.name == tx.name == "nixl" and rx.in_band is False
        assert nixl.NixlSenderPlane.takes_timeout is True  # PushSender hands it transfer_timeout
    finally:
        tx.close()
        rx.close()


# --- end to end: EmbeddingReceiver + PushSender over the nixl plane --------------------------

def _outputs(items, seed):
    from epd_encoder.types import ItemOutput

    g = torch.Generator().manual_seed(seed)

    def t(item):
        return torch.randn(item.num_tokens, item.hidden_size, generator=g).to(getattr(torch, item.dtype))

    return [ItemOutput(t(it), tuple(t(it) for _ in range(it.num_deepstack)) or None) for it in items]


@pytest.mark.timeout(60)
def test_push_end_to_end_over_nixl_with_two_tp_ranks(monkeypatch):
    _require_nixl()
    monkeypatch.setitem(base._BACKENDS, "nixl", _ENTRY)
    from epd_encoder.transfer.receiver import EmbeddingReceiver
    from epd_encoder.transfer.sender import PushSender

    items = [WireItem("img-a", 12, (1, 6, 8), 40, "bfloat16", num_deepstack=2),
             WireItem("img-b", 5, (1, 2, 10), 40, "bfloat16", num_deepstack=2)]
    outputs = _outputs(items, seed=9)
    released = threading.Event()
    done = []
    with EmbeddingReceiver("nixl", pool_bytes=MiB, tp_rank=0, tp_size=2) as r0, \
            EmbeddingReceiver("nixl", pool_bytes=MiB, tp_rank=1, tp_size=2) as r1:
        r1.expect("room-1")
        delivery = r0.delivery("room-1", peers=[r1.target()], items=items)
        assert delivery["backend"] == "nixl"
        assert {t["info"]["agent"] for t in delivery["targets"]} == {r0.plane.info()["agent"],
                                                                   r1.plane.info()["agent"]}
        sender = PushSender(sender_id="enc-0", transfer_timeout=10.0)
        try:
            handle = sender.open(delivery, "req-1", items, on_done=done.append)
            handle.deliver(outputs, released.set)
            for rx in (r0, r1):
                got = rx.wait("room-1", timeout=20)
                assert [g.key for g in got] == ["img-a", "img-b"]
                for g, want in zip(got, outputs):
                    assert torch.equal(_bits(g.embedding), _bits(want.embedding))
                    assert len(g.deepstack) == 2
                    for a, b in zip(g.deepstack, want.deepstack):
                        assert torch.equal(_bits(a), _bits(b))
            assert released.wait(10)
        finally:
            sender.close()
        assert done and done[0]["state"] == "done"
        assert r0.plane.pool.used_bytes == 0 and r1.plane.pool.used_bytes == 0


@pytest.mark.timeout(60)
def test_push_end_to_end_unreachable_agent_fails_the_room_on_both_sides(monkeypatch):
    _require_nixl()
    monkeypatch.setitem(base._BACKENDS, "nixl", _ENTRY)
    from epd_encoder.transfer.receiver import EmbeddingReceiver
    from epd_encoder.transfer.sender import PushSender

    items = [WireItem("img", 8, (1, 4, 8), 32, "float32")]
    dead = nixl.NixlReceiverPlane(MiB)
    dead_info = dead.info()
    dead.close()
    with EmbeddingReceiver("nixl", pool_bytes=MiB) as rx:
        # The control plane stays up while the data plane's agent is unreachable.
        live = rx.plane.info()
        monkeypatch.setattr(rx.plane, "info", lambda: {**live, "agent": dead_info["agent"],
                                                       "metadata": dead_info["metadata"]})
        delivery = rx.delivery("room-x", items=items)
        sender = PushSender(sender_id="enc-1", transfer_timeout=10.0)
        try:
            done = []
            handle = sender.open(delivery, "req-x", items, on_done=done.append)
            handle.deliver(_outputs(items, 1), lambda: None)
            with pytest.raises(EncodeFailed, match="nixl"):
                rx.wait("room-x", timeout=20)
            assert done and done[0]["state"] == "failed" and done[0]["code"] == EncodeFailed.code
        finally:
            sender.close()
        assert rx.plane.pool.used_bytes == 0
