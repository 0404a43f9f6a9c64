# SPDX-License-Identifier: Apache-2.0
"""The NIXL plane's bookkeeping against a fake agent: runs without NIXL installed."""
import base64
import functools
import sys
import time

import pytest
import torch

from epd_encoder.errors import ConfigError, EncodeFailed, InvalidInput
from epd_encoder.transfer.planes import nixl
from epd_encoder.transfer.base import Region

MiB = 1 << 20
_ENTRY = ("epd_encoder.transfer.planes.nixl:NixlReceiverPlane", "epd_encoder.transfer.planes.nixl:NixlSenderPlane")


@functools.cache

def _no_frames(frames):
    raise AssertionError("the nixl plane writes out of band: it must never send frames")


# --- without NIXL: fakes ----------------------------------------------------------------------

class _FakeAgent:
    """Records calls; transfers stay in progress ``pending`` polls, then finish (or fail)."""

    def __init__(self, name, pending=0, fail=None, cancellable=True, register_error=None):
        self.name = name
        self.registered, self.unregistered, self.added, self.removed, self.posts = [], [], [], [], []
        self.pending, self.fail, self.cancellable, self.register_error = pending, fail, cancellable, register_error
        self.released = 0

    def register_memory(self, ptr, n):
        if self.register_error:
            raise ConfigError(self.register_error)
        self.registered.append((ptr, n))

    def unregister_memory(self, ptr):
        self.unregistered.append(ptr)

    def metadata(self):
        return self.name.encode()

    def add_remote(self, md):
        self.added.append(md)
        return md.decode()

    def remove_remote(self, name):
        self.removed.append(name)

    def post_write(self, remote, local, dest):
        self.posts.append((remote, local, dest))
        self._left = self.pending
        return len(self.posts), self.pending == 0 and self.fail is None

    def done(self, handle):
        if self._left > 0:
            self._left -= 1
            return False
        if self.fail:
            raise self.fail
        return True

    def release(self, handle):
        self.released += 1
        return self.cancellable


def _fake(monkeypatch, **kw):
    agents = []

    def make(name, **options):
        agents.append(_FakeAgent(name, **kw))
        return agents[-1]

    monkeypatch.setattr(nixl, "_Agent", make)
    return agents


def _peer(name="epd-rx-peer", base_addr=1 << 30, size=MiB):
    return {"agent": name, "metadata": base64.b64encode(name.encode()).decode(), "base": base_addr, "size": size}


def test_construction_without_nixl_names_the_package(monkeypatch):
    for module in nixl._MODULES:
        monkeypatch.setitem(sys.modules, module.partition(".")[0], None)
        monkeypatch.setitem(sys.modules, module, None)
    for build in (lambda: nixl.NixlReceiverPlane(MiB), nixl.NixlSenderPlane):
        with pytest.raises(ConfigError, match="pip install nixl-cu12") as info:
            build()
        assert isinstance(info.value.__cause__, ImportError)


def test_receiver_registers_once_quarantines_and_unregisters_on_close(monkeypatch):
    agents = _fake(monkeypatch)
    rx = nixl.NixlReceiverPlane(64 * 1024)
    fake = agents[0]
    for r in [rx.allocate(1000) for _ in range(20)]:
        rx.free(r)
    regions = [rx.allocate(3000) for _ in range(10)]
    assert fake.registered == [(rx.info()["base"], 64 * 1024)]
    assert rx.info()["agent"] == fake.name and base64.b64decode(rx.info()["metadata"]) == fake.name.encode()
    assert rx.capacity == 64 * 1024
    rx.free(regions[0], failed=True)  # a late one-sided write may still land there
    assert rx.pool.quarantined_bytes > 0
    assert all(rx.allocate(3000).offset != regions[0].offset for _ in range(5))
    rx.close()
    rx.close()
    assert fake.unregistered == [rx.info()["base"]]
    with pytest.raises(ConfigError):
        rx.allocate(10)


def test_write_frame_and_view_stay_inside_the_buffer(monkeypatch):
    _fake(monkeypatch)
    rx = nixl.NixlReceiverPlane(4096)
    region = rx.allocate(128)
    rx.write_frame(region, 64, memoryview(bytes(range(64))))
    assert rx.view(region)[64:].tolist() == list(range(64))
    with pytest.raises(InvalidInput):
        rx.write_frame(region, 100, memoryview(bytes(64)))
    with pytest.raises(InvalidInput):
        rx.view(Region(4000, 200))
    with pytest.raises(ConfigError):
        nixl.NixlReceiverPlane(4096, progress_delay_us=0)


def test_remote_agent_is_loaded_once_and_reloaded_after_a_failure(monkeypatch):
    agents = _fake(monkeypatch)
    tx = nixl.NixlSenderPlane(timeout=5)
    fake, peer = agents[0], _peer()
    dest = {"addr": peer["base"] + 4096, "nbytes": 4096}
    for _ in range(3):
        tx.write(peer, dest, [(0, torch.ones(8)), (64, torch.ones(8))], _no_frames)
    assert fake.added == [b"epd-rx-peer"] and len(fake.posts) == 3
    remote, local, remote_spans = fake.posts[0]
    assert remote == "epd-rx-peer" and remote_spans == [(peer["base"] + 4096, 96)]  # padding bridged
    assert local[0][1] == 96 and fake.released == 3
    fake.fail = RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
    with pytest.raises(EncodeFailed, match="REMOTE_DISCONNECT"):
        tx.write(peer, dest, [(0, torch.ones(8))], _no_frames)
    assert fake.removed == ["epd-rx-peer"]
    fake.fail = None
    tx.write(peer, dest, [(0, torch.ones(8))], _no_frames)
    assert fake.added == [b"epd-rx-peer", b"epd-rx-peer"]


def test_peer_cache_is_bounded_and_checks_the_metadata(monkeypatch):
    agents = _fake(monkeypatch)
    tx = nixl.NixlSenderPlane(timeout=5, max_peers=2)
    fake = agents[0]
    for name in ("epd-rx-a", "epd-rx-b", "epd-rx-c"):
        p = _peer(name)
        tx.write(p, {"addr": p["base"], "nbytes": 64}, [(0, torch.ones(4))], _no_frames)
    assert fake.removed == ["epd-rx-a"]
    liar = {**_peer("epd-rx-d"), "metadata": base64.b64encode(b"epd-rx-other").decode()}
    with pytest.raises(EncodeFailed, match="not the advertised"):
        tx.write(liar, {"addr": liar["base"], "nbytes": 64}, [(0, torch.ones(4))], _no_frames)
    assert "epd-rx-other" in fake.removed
    garbled = {**_peer("epd-rx-e"), "metadata": "%%%not base64"}
    with pytest.raises(EncodeFailed, match="malformed"):
        tx.write(garbled, {"addr": garbled["base"], "nbytes": 64}, [(0, torch.ones(4))], _no_frames)
    assert len(fake.posts) == 3  # nothing was posted for the bad peers


def test_a_stuck_transfer_times_out_and_its_staging_is_never_reused(monkeypatch):
    agents = _fake(monkeypatch, pending=10 ** 9, cancellable=False)
    now = [0.0]

    def clock():
        now[0] += 0.01
        return now[0]

    monkeypatch.setattr(nixl, "_MAX_NAP_S", 0.0)
    monkeypatch.setattr(nixl, "_NAP_STEP_S", 0.0)
    tx = nixl.NixlSenderPlane(timeout=2.0, clock=clock)
    fake, peer = agents[0], _peer()
    dest = {"addr": peer["base"], "nbytes": 64}
    start = time.monotonic()
    with pytest.raises(EncodeFailed, match="did not complete within 2.0s.*could not be cancelled"):
        tx.write(peer, dest, [(0, torch.ones(4))], _no_frames)
    assert time.monotonic() - start < 5
    assert fake.removed == ["epd-rx-peer"]
    first = fake.posts[0][1][0][0]
    fake.pending, fake.cancellable = 0, True
    tx.write(peer, dest, [(0, torch.ones(4))], _no_frames)
    assert fake.posts[1][1][0][0] != first  # the retired buffer stays out of use
    assert tx._staging.buffers == 2
    tx.close()
    assert len(fake.unregistered) == 2  # the retired buffer is unregistered at close only


def test_a_cancelled_timeout_returns_its_staging(monkeypatch):
    agents = _fake(monkeypatch, pending=10 ** 9, cancellable=True)
    now = [0.0]
    monkeypatch.setattr(nixl, "_MAX_NAP_S", 0.0)
    monkeypatch.setattr(nixl, "_NAP_STEP_S", 0.0)
    tx = nixl.NixlSenderPlane(timeout=1.0, clock=lambda: now.__setitem__(0, now[0] + 0.01) or now[0])
    peer = _peer()
    with pytest.raises(EncodeFailed, match="did not complete within 1.0s") as info:
        tx.write(peer, {"addr": peer["base"], "nbytes": 64}, [(0, torch.ones(4))], _no_frames)
    assert "cancelled" not in str(info.value)
    agents[0].pending = 0
    tx.write(peer, {"addr": peer["base"], "nbytes": 64}, [(0, torch.ones(4))], _no_frames)
    assert tx._staging.buffers == 1


def test_staging_reuses_then_regrows_in_powers_of_two():
    fake = _FakeAgent("x")
    staging = nixl._Staging(fake, pin_memory=False)
    a = staging.acquire(1000)
    assert a.numel() == MiB
    staging.release(a)
    assert staging.acquire(MiB) is a and len(fake.registered) == 1
    b = staging.acquire(10)  # a is busy: a second buffer for a concurrent write
    assert b is not a and len(fake.registered) == 2
    staging.release(a)
    staging.release(b)
    c = staging.acquire(3 * MiB)
    assert c.numel() == 4 * MiB and len(fake.unregistered) == 1
    staging.close()
    assert len(fake.unregistered) == 2  # c is still busy: dropped when it comes back
    staging.release(c)
    assert len(fake.unregistered) == 3
    with pytest.raises(EncodeFailed, match="closed"):
        staging.acquire(10)


def test_registration_failures_are_typed(monkeypatch):
    _fake(monkeypatch, register_error="NIXL registerMem of 4096 bytes failed")
    with pytest.raises(ConfigError, match="registerMem"):
        nixl.NixlReceiverPlane(4096)
    with pytest.raises(EncodeFailed, match="registerMem"):
        nixl._Staging(_FakeAgent("x", register_error="registerMem failed"), pin_memory=False).acquire(10)
