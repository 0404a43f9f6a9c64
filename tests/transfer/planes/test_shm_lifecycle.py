# SPDX-License-Identifier: Apache-2.0
"""Segment lifecycle: close, GC, interpreter exit, and the crash of either side."""
from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

from epd_encoder.errors import ConfigError
from epd_encoder.transfer.planes.shm import PREFIX, ShmReceiverPlane, ShmSenderPlane, sweep_stale

from tests.transfer.shm_helpers import SHM, spawn

pytestmark = pytest.mark.usefixtures("nothing_left_behind")


def test_close_unlinks_is_idempotent_and_outstanding_views_stay_readable(tx):
    rx = ShmReceiverPlane(pool_bytes=4096)
    r = rx.allocate(64)
    tx.write(rx.info(), rx.destination(r), [(0, torch.full((16,), 3.0))], None)
    view = rx.view(r)
    rx.close()
    rx.close()
    assert not os.path.exists(rx.path)
    assert torch.equal(view.view(torch.float32), torch.full((16,), 3.0))
    with pytest.raises(ConfigError):
        rx.view(r)
    with pytest.raises(ConfigError):
        rx.allocate(64)


def test_garbage_collected_receiver_unlinks_its_segment():
    rx = ShmReceiverPlane(pool_bytes=4096)
    path = rx.path
    del rx
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.slow
def test_interpreter_exit_unlinks_but_a_forked_child_exiting_does_not():
    proc = spawn("""
        import os, sys
        from epd_encoder.transfer.planes.shm import ShmReceiverPlane
        rx = ShmReceiverPlane(pool_bytes=4096)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit runs atexit in the child too
        os.waitpid(pid, 0)
        print(rx.path, os.path.exists(rx.path), flush=True)
    """)
    out, _ = proc.communicate(timeout=120)
    path, alive_after_child = out.split()
    assert proc.returncode == 0 and alive_after_child == "True"
    assert not os.path.exists(path)


@pytest.mark.slow
def test_receiver_killed_leaves_a_segment_the_next_receiver_sweeps():
    proc = spawn("""
        import time
        from epd_encoder.transfer.planes.shm import ShmReceiverPlane
        rx = ShmReceiverPlane(pool_bytes=4096)
        print(rx.segment, flush=True)
        time.sleep(600)
    """)
    try:
        segment = proc.stdout.readline().strip()
        path = os.path.join(SHM, segment)
        fresh = ShmReceiverPlane(pool_bytes=4096)  # the owner is alive: its segment stays
        fresh.close()
        assert segment not in fresh.swept and os.path.exists(path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert os.path.exists(path)  # SIGKILL ran no cleanup
    survivor = ShmReceiverPlane(pool_bytes=4096)
    try:
        assert segment in survivor.swept and not os.path.exists(path)
        assert survivor.segment not in sweep_stale()  # a live segment is never swept
        assert os.path.exists(survivor.path)
    finally:
        survivor.close()


@pytest.mark.slow
def test_sender_killed_mid_write_leaves_the_receiver_intact():
    rx = ShmReceiverPlane(pool_bytes=16 << 20)
    try:
        region = rx.allocate(16 << 20)
        proc = spawn(f"""
            import torch
            from epd_encoder.transfer.planes.shm import ShmSenderPlane
            tx, src = ShmSenderPlane(), torch.full(({4 << 20},), 1.0)
            info, dest = {rx.info()!r}, {rx.destination(region)!r}
            tx.write(info, dest, [(0, src)], None)
            print("ready", flush=True)
            while True:
                tx.write(info, dest, [(0, src)], None)
        """)
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert os.path.exists(rx.path) and rx.segment not in sweep_stale()
        assert torch.equal(rx.view(region).view(torch.float32), torch.full((4 << 20,), 1.0))
        tx = ShmSenderPlane()
        tx.write(rx.info(), rx.destination(region), [(0, torch.full((4 << 20,), 2.0))], None)
        tx.close()
        assert torch.equal(rx.view(region).view(torch.float32), torch.full((4 << 20,), 2.0))
    finally:
        rx.close()
    assert not os.path.exists(rx.path)


def test_sender_close_during_a_copy_keeps_the_mapping_until_the_copy_ends(rx, tx):
    region = rx.allocate(64)
    tx.write(rx.info(), rx.destination(region), [(0, torch.ones(16))], None)
    base = tx._mapping(rx.segment, rx.info()["inode"])  # what a write in flight holds
    tx.close()
    base[region.offset:region.offset + 64].fill_(4)
    assert rx.view(region).tolist() == [4] * 64


def test_sweep_trusts_the_lock_not_the_pid(tmp_path):
    reused = tmp_path / f"{PREFIX}{os.getpid()}-deadbeef"  # our pid is alive, but nobody holds it
    reused.write_bytes(b"\0" * 64)
    other = tmp_path / "epd-other"
    other.write_bytes(b"")
    live = ShmReceiverPlane(pool_bytes=4096, shm_dir=str(tmp_path))
    try:
        assert live.swept == [reused.name]
        assert not reused.exists() and other.exists() and os.path.exists(live.path)
        assert sweep_stale(str(tmp_path)) == []
    finally:
        live.close()
