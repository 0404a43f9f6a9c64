# SPDX-License-Identifier: Apache-2.0
"""The shared tier over a fake store: lookups, write-behind, corrupt entries, a store that fails."""

from __future__ import annotations

import asyncio
import threading

import torch

from epd_encoder.cache.shared import SharedTier
from epd_encoder.cache.shared_breaker import Breaker
from epd_encoder.cache.shared_client import GuardedStore
from epd_encoder.cache.shared_format import meta_key, value_key
from epd_encoder.cache.shared_mooncake import INVALID_PARAMS, StoreError
from epd_encoder.types import ItemOutput
from tests.e2e.harness import wait_for

KEY = bytes(range(32))
GRID = (1, 4, 4)


class FakeStore:
    """A dict with Mooncake's outcomes; ``gate`` holds reads, ``write_gate`` writes, ``down`` fails all;
    ``leases`` counts the removes each key still refuses (-706)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.reads: list[str] = []
        self.puts: list[str] = []
        self.leases: dict[str, int] = {}
        self.removed: list[str] = []
        self.gate: threading.Event | None = None
        self.write_gate: threading.Event | None = None
        self.down = False

    def read(self, key, into):
        if self.gate is not None:
            self.gate.wait(30)
        if self.down:
            raise StoreError("get", -900)
        self.reads.append(key)
        obj = self.objects.get(key)
        if obj is None:
            return None
        if len(obj) > into.numel():
            return INVALID_PARAMS
        into[:len(obj)] = torch.frombuffer(bytearray(obj), dtype=torch.uint8)
        return len(obj)

    def write(self, key, *parts):
        value = b"".join(bytes(p) for p in parts)
        if self.write_gate is not None:
            self.write_gate.wait(30)
        if self.down:
            raise StoreError("put", -900)
        self.puts.append(key)
        if key in self.objects:
            return "exists"
        self.objects[key] = bytes(value)
        return "stored"

    def remove(self, key):
        if self.leases.get(key, 0) > 0:
            self.leases[key] -= 1
            return False
        self.objects.pop(key, None)
        self.removed.append(key)
        return True

    def close(self):
        pass


def _tier(fake: FakeStore, *, queue=8, failures=3, lease_s=0.01, write_deadline=10.0) -> SharedTier:
    store = GuardedStore(lambda: fake, Breaker(failures, 60.0), read_threads=2)
    tier = SharedTier(store, namespace="ns", read_deadline_s=10.0, write_deadline_s=write_deadline,
                      write_queue=queue, max_bytes=1 << 20, lease_s=lease_s)
    tier.start()
    assert wait_for(lambda: store.connected)
    return tier


def _output(seed=0) -> ItemOutput:
    g = torch.Generator().manual_seed(seed)
    return ItemOutput(torch.randn(4, 8, generator=g), (torch.randn(4, 8, generator=g),))


def _lookup(tier, key=KEY, grid=GRID, tokens=4):
    return asyncio.run(tier.lookup(key, grid_thw=grid, num_tokens=tokens))


def _write(tier, out, key=KEY):
    before = tier.stats.writes
    assert tier.offer(key, out, grid_thw=GRID, modality="image")
    assert wait_for(lambda: tier.stats.writes == before + 1)


def test_a_written_item_is_read_back_whole():
    fake = FakeStore()
    tier = _tier(fake)
    try:
        assert _lookup(tier) is None
        out = _output()
        _write(tier, out)
        assert set(fake.objects) == {value_key("ns", KEY.hex()), meta_key("ns", KEY.hex())}
        got = _lookup(tier)
        assert torch.equal(got.embedding, out.embedding) and torch.equal(got.deepstack[0], out.deepstack[0])
        s = tier.stats
        assert (s.hits, s.misses, s.corrupt) == (1, 1, 0) and s.bytes_read == s.bytes_written > 0
    finally:
        tier.close()


def test_concurrent_lookups_of_one_key_make_one_store_read():
    fake = FakeStore()
    tier = _tier(fake)
    try:
        _write(tier, _output())
        fake.gate = threading.Event()

        async def many():
            tasks = [asyncio.ensure_future(tier.lookup(KEY, grid_thw=GRID, num_tokens=4)) for _ in range(5)]
            await asyncio.sleep(0)
            await asyncio.get_running_loop().run_in_executor(None, fake.gate.set)
            return await asyncio.gather(*tasks)

        results = asyncio.run(many())
        assert all(r is results[0] is not None for r in results)
        assert len(fake.reads) == 2  # one sidecar read and one object read, for five lookups
    finally:
        tier.close()


def test_a_cancelled_lookup_leaves_the_others_their_answer():
    fake = FakeStore()
    tier = _tier(fake)
    try:
        _write(tier, _output())
        fake.gate = threading.Event()

        async def main():
            first = asyncio.ensure_future(tier.lookup(KEY, grid_thw=GRID, num_tokens=4))
            second = asyncio.ensure_future(tier.lookup(KEY, grid_thw=GRID, num_tokens=4))
            await asyncio.sleep(0)
            first.cancel()
            fake.gate.set()
            return await second

        assert asyncio.run(main()) is not None
    finally:
        tier.close()


def test_a_corrupt_entry_is_a_counted_miss_and_removed_after_the_lease():
    fake = FakeStore()
    tier = _tier(fake)
    try:
        _write(tier, _output())
        vkey, mkey = value_key("ns", KEY.hex()), meta_key("ns", KEY.hex())
        fake.objects[vkey] = fake.objects[vkey][:-1] + b"\x00"
        fake.leases = {mkey: 1, vkey: 2}  # the read's lease refuses the first removes (-706)
        assert _lookup(tier) is None
        assert tier.stats.corrupt == 1 and tier.stats.misses == 1
        assert wait_for(lambda: tier.stats.removals == 1)
        assert vkey not in fake.objects and mkey not in fake.objects
        out = _output(1)  # the key is written afresh once the bad entry is gone
        _write(tier, out)
        assert torch.equal(_lookup(tier).embedding, out.embedding)
    finally:
        tier.close()


def test_an_object_without_our_sidecar_is_a_miss_and_gets_none_from_us():
    fake = FakeStore()
    tier = _tier(fake)
    try:
        fake.objects[value_key("ns", KEY.hex())] = b"written by someone else"
        assert _lookup(tier) is None
        assert tier.offer(KEY, _output(), grid_thw=GRID, modality="image")
        other = bytes(32)
        _write(tier, _output(), other)  # the writer is sequential: the first job has ended
        assert fake.puts == [value_key("ns", KEY.hex()), value_key("ns", other.hex()), meta_key("ns", other.hex())]
        assert tier.stats.writes == 1
    finally:
        tier.close()


def test_an_object_whose_sidecar_write_failed_is_removed_so_the_key_is_written_again():
    fake = FakeStore()
    tier = _tier(fake)
    write, fails = fake.write, [1]

    def failing_sidecar(key, *parts):
        if key == meta_key("ns", KEY.hex()) and fails[0]:
            fails[0] -= 1
            raise StoreError("put", -900)
        return write(key, *parts)

    fake.write = failing_sidecar
    try:
        assert tier.offer(KEY, _output(), grid_thw=GRID, modality="image")
        assert wait_for(lambda: tier.stats.errors.get(("put", "error")) == 1)
        # Left in place, no server would ever sidecar it ("exists"): a miss fleet-wide for good.
        assert wait_for(lambda: value_key("ns", KEY.hex()) not in fake.objects)
        out = _output(1)
        _write(tier, out)
        assert torch.equal(_lookup(tier).embedding, out.embedding)
    finally:
        tier.close()


def test_an_object_that_lands_after_its_write_timed_out_is_removed_so_the_key_is_written_again():
    fake = FakeStore()
    fake.write_gate = threading.Event()
    tier = _tier(fake, write_deadline=0.05, failures=10)
    try:
        assert tier.offer(KEY, _output(), grid_thw=GRID, modality="image")
        assert wait_for(lambda: tier.stats.errors.get(("put", "timeout")) == 1)
        fake.write_gate.set()  # the late put lands, with no sidecar after it
        assert wait_for(lambda: value_key("ns", KEY.hex()) in fake.removed)
        assert value_key("ns", KEY.hex()) not in fake.objects
        out = _output(1)
        _write(tier, out)
        assert torch.equal(_lookup(tier).embedding, out.embedding)
    finally:
        fake.write_gate.set()
        tier.close()


def test_close_stops_the_writer_even_when_an_offer_refills_the_queue_as_it_drains():
    fake = FakeStore()
    fake.write_gate = threading.Event()
    tier = _tier(fake, queue=1)
    try:
        assert tier.offer(KEY, _output(), grid_thw=GRID, modality="image")
        assert wait_for(lambda: tier.queued_writes == 0)  # the writer holds it, stuck in the store
        drain, late = tier._drain_queue, []

        def drain_then_offer():  # an engine-thread offer landing between the drain and the stop
            drain()
            late.append(tier.offer(bytes(32), _output(), grid_thw=GRID, modality="image"))

        tier._drain_queue = drain_then_offer  # type: ignore[method-assign]
        tier.close()  # raised queue.Full, leaving the writer running and the runtime's stop unfinished
        assert late == [False]  # refused once closing: nothing is written after close
        fake.write_gate.set()
        assert wait_for(lambda: not tier._writer.is_alive())
    finally:
        fake.write_gate.set()


def test_offers_never_block_and_overflow_is_dropped_and_counted():
    fake = FakeStore()
    fake.write_gate = threading.Event()
    tier = _tier(fake, queue=2)
    try:
        keys = [bytes([i]) * 32 for i in range(6)]
        results = [tier.offer(k, _output(), grid_thw=GRID, modality="image") for k in keys[:1]]
        assert wait_for(lambda: tier.queued_writes == 0)  # the writer holds the first, stuck in the store
        results += [tier.offer(k, _output(), grid_thw=GRID, modality="image") for k in keys[1:]]
        assert results == [True, True, True, False, False, False]
        assert tier.stats.dropped == {"queue_full": 3}
        fake.write_gate.set()
        assert wait_for(lambda: tier.stats.writes == 3)
    finally:
        fake.write_gate.set()
        tier.close()


def test_a_failing_store_gives_misses_then_the_breaker_skips_it():
    fake = FakeStore()
    tier = _tier(fake, failures=2)
    try:
        fake.down = True
        for _ in range(4):
            assert _lookup(tier) is None
        assert tier.stats.errors == {("get", "error"): 2, ("get", "open"): 2}
        assert tier.store.breaker.state == "open"
        assert tier.offer(KEY, _output(), grid_thw=GRID, modality="image")
        assert wait_for(lambda: tier.stats.errors.get(("put", "open")) == 1)
    finally:
        tier.close()


def test_a_stuck_write_times_out_and_the_writer_goes_on():
    fake = FakeStore()
    fake.write_gate = threading.Event()
    tier = _tier(fake, write_deadline=0.05, failures=10)
    try:
        assert tier.offer(KEY, _output(), grid_thw=GRID, modality="image")
        assert wait_for(lambda: tier.stats.errors.get(("put", "timeout")) == 1)
        # The write thread is still held: the next write waits its deadline in the queue, then gives up.
        assert tier.offer(bytes(32), _output(), grid_thw=GRID, modality="image")
        assert wait_for(lambda: tier.stats.errors.get(("put", "timeout")) == 2)
        fake.write_gate.set()
        assert wait_for(lambda: fake.puts == [value_key("ns", KEY.hex())])  # the stuck one ends; the other never ran
    finally:
        fake.write_gate.set()
        tier.close()


def test_more_concurrent_lookups_than_read_threads_all_hit():
    fake = FakeStore()
    tier = _tier(fake)  # two read threads
    keys = [bytes([i]) * 32 for i in range(8)]
    try:
        for k in keys:
            _write(tier, _output(), k)
        fake.gate = threading.Event()

        async def burst():
            tasks = [asyncio.ensure_future(tier.lookup(k, grid_thw=GRID, num_tokens=4)) for k in keys]
            await asyncio.sleep(0)
            await asyncio.get_running_loop().run_in_executor(None, fake.gate.set)
            return await asyncio.gather(*tasks)

        assert all(r is not None for r in asyncio.run(burst()))  # queued behind the busy threads, not missed
        assert tier.stats.hits == 8 and not tier.stats.errors
    finally:
        tier.close()
