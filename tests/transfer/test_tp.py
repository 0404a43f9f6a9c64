# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel prefill: every rank gets a full copy; all ranks agree on one outcome."""

import pytest

from epd_encoder.errors import ConfigError, Overloaded
from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer.sender import PushSender
from tests.transfer import Release, assert_same, make_room, wait_for


@pytest.fixture
def tx():
    s = PushSender(sender_id="enc-tp", bootstrap_timeout=2.0, transfer_timeout=2.0)
    yield s
    s.close()


def test_two_ranks_each_get_a_full_copy_and_agree_on_done(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, tp_rank=0, tp_size=2) as r0, \
            EmbeddingReceiver("tcp", pool_bytes=1 << 20, tp_rank=1, tp_size=2) as r1:
        items, outputs = make_room(2, n_ds=2)
        d = r0.delivery("tp", peers=[r1.target()])
        assert [t["rank"] for t in d["targets"]] == [0, 1]
        r1.expect("tp")
        rel = Release()
        tx.open(d, "q", items).deliver(outputs, rel)
        assert_same(r0.wait("tp", timeout=5), outputs, items)
        assert_same(r1.wait("tp", timeout=5), outputs, items)
        assert rel.wait(2) and rel.calls == 1 and tx.status("tp", r0.endpoint)["state"] == "done"


def test_a_rank_that_never_registered_still_receives(tx):
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, tp_size=2) as r0, \
            EmbeddingReceiver("tcp", pool_bytes=1 << 20, tp_rank=1, tp_size=2) as r1:
        items, outputs = make_room(1)
        tx.open(r0.delivery("tp", peers=[r1.target()]), "q", items).deliver(outputs, Release())
        assert wait_for(lambda: r1.ready_rooms() == ["tp"])
        assert_same(r1.result("tp"), outputs, items)
        assert_same(r0.wait("tp", timeout=5), outputs, items)


def test_one_rank_refusing_fails_both_with_the_same_reason(tx):
    items, outputs = make_room(1, tokens=64, hidden=64)  # 16 KiB
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, tp_size=2) as r0, \
            EmbeddingReceiver("tcp", pool_bytes=4 << 10, tp_rank=1, tp_size=2) as r1:
        r1.expect("tp")
        rel = Release()
        tx.open(r0.delivery("tp", peers=[r1.target()]), "q", items).deliver(outputs, rel)
        errors = []
        for rx in (r0, r1):
            with pytest.raises(Overloaded) as e:
                rx.wait("tp", timeout=5)
            errors.append(str(e.value))
        assert errors[0] == errors[1] and "rank 1" in errors[0] and "pool holds" in errors[0]
        assert rel.wait(2) and tx.status("tp", r0.endpoint)["code"] == "overloaded"
        assert wait_for(lambda: r0.plane.pool.used_bytes == 0 and r1.plane.pool.used_bytes == 0)


def test_delivery_checks_the_tp_ranks():
    with EmbeddingReceiver("tcp", pool_bytes=1 << 20, tp_size=2) as r0:
        with pytest.raises(ConfigError, match="tp_size"):
            r0.delivery("x")
        with pytest.raises(ValueError, match="repeat"):
            r0.delivery("x", peers=[r0.target()])
