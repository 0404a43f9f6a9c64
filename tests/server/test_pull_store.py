# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

from epd_encoder.server.pull_store import PullStore


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_ttl_expires_entries():
    clock = Clock()
    store = PullStore(ttl_s=10, capacity_bytes=100, clock=clock)
    assert store.put("a", "A", 10)
    clock.t = 9.9
    assert store.get("a") == "A"
    clock.t = 10.0
    assert store.get("a") is None and store.current_bytes == 0 and len(store) == 0


def test_byte_bound_evicts_oldest_first_and_refuses_oversize():
    store = PullStore(ttl_s=100, capacity_bytes=30, clock=Clock())
    for k in "abc":
        store.put(k, k.upper(), 10)
    store.put("d", "D", 15)
    assert store.get("a") is None and store.get("b") is None
    assert store.get("c") == "C" and store.get("d") == "D" and store.current_bytes == 25
    assert not store.put("huge", "H", 31) and store.current_bytes == 25


def test_reput_refreshes_and_keeps_accounting_exact():
    clock = Clock()
    store = PullStore(ttl_s=10, capacity_bytes=100, clock=clock)
    store.put("a", 1, 40)
    clock.t = 8
    store.put("a", 2, 20)
    clock.t = 15
    assert store.get("a") == 2 and store.current_bytes == 20


def test_bad_bounds():
    with pytest.raises(ValueError):
        PullStore(ttl_s=0, capacity_bytes=1)
