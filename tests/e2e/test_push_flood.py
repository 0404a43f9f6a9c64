# SPDX-License-Identifier: Apache-2.0
"""A flood of pushes to dead endpoints neither starves a working receiver nor keeps threads and fds."""

from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

from epd_encoder.config import PushConfig
from epd_encoder.receiver import EmbeddingReceiver
from tests.e2e.harness import Server, body, png, serve_config, wait_for

MAX_PEERS, PROVEN_SLOTS = 12, 4  # so 8 slots for endpoints that never answered


def dead_endpoint() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


def dead_delivery(room: str) -> dict:
    return {"mode": "push", "backend": "tcp", "room": room,
            "targets": [{"endpoint": dead_endpoint(), "rank": 0, "info": {}}]}


def peer_threads() -> int:
    return sum(t.name.startswith("epd-tx-") for t in threading.enumerate())


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def flooded(tiny_dir):
    push = replace(PushConfig(), bootstrap_timeout=1.0, max_push_peers=MAX_PEERS, proven_peer_slots=PROVEN_SLOTS)
    s = Server(serve_config(tiny_dir, push=push)).start()
    yield s
    s.stop()


def test_a_dead_endpoint_flood_gets_429_and_leaves_a_proven_receiver_working(flooded, capsys):
    image = png(4000)
    with EmbeddingReceiver("tcp", pool_bytes=8 << 20) as rx, \
            httpx.Client(base_url=flooded.url, timeout=30) as c:
        first = c.post("/v1/encode", json=body(image, delivery=rx.delivery("proof")))
        assert first.status_code == 202, first.text
        rx.wait("proof", timeout=20)  # rx has now completed a handshake: it is proven
        threads0, fds0, peers0 = threading.active_count(), fds(), peer_threads()

        # Phase 1, the tower held: every flood room stays open, so the caps are exact.
        with flooded.paused_engine():
            flood = [c.post("/v1/encode", json=body(image, delivery=dead_delivery(f"dead-{i}")))
                     for i in range(2 * MAX_PEERS)]
            codes = [r.status_code for r in flood]
            assert codes == [202] * (MAX_PEERS - PROVEN_SLOTS) + [429] * (MAX_PEERS + PROVEN_SLOTS), codes
            assert all(r.json()["error"]["code"] == "overloaded" for r in flood if r.status_code == 429)
            held = c.post("/v1/encode", json=body(image, delivery=rx.delivery("while-flooded")))
            assert held.status_code == 202, held.text  # a proven receiver keeps its channel
            with EmbeddingReceiver("tcp", pool_bytes=1 << 20) as unknown:  # never answered this server
                late = c.post("/v1/encode", json=body(image, delivery=unknown.delivery("new")))
                assert late.status_code == 429, late.text  # the unproven share is full; no 202 then failure
            peak_threads, peak_fds = threading.active_count(), fds()
        assert rx.wait("while-flooded", timeout=20)[0].key == held.json()["items"][0]["key"]
        # The dead peers retire once their bootstrap fails, long before the 60 s idle timeout.
        assert wait_for(lambda: peer_threads() <= peers0, timeout=20), (peer_threads(), peers0)

        # Phase 2, the tower running and the slots free: the flood goes on while the receiver receives.
        stop, answers = threading.Event(), []

        def flood_until_stopped(worker: int) -> None:
            with httpx.Client(base_url=flooded.url, timeout=30) as own:  # its sockets close with it
                i = 0
                while not stop.is_set():
                    r = own.post("/v1/encode", json=body(image, delivery=dead_delivery(f"dead-{worker}-{i}")))
                    answers.append(r.status_code)
                    i += 1

        with ThreadPoolExecutor(4) as pool:
            floods = [pool.submit(flood_until_stopped, w) for w in range(4)]
            try:
                for i in range(8):
                    r = c.post("/v1/encode", json=body(png(4001 + i), delivery=rx.delivery(f"real-{i}")))
                    assert r.status_code == 202, r.text
                    assert rx.wait(f"real-{i}", timeout=20)[0].key == r.json()["items"][0]["key"]
            finally:
                stop.set()
            for f in floods:
                f.result()
        assert set(answers) <= {202, 429} and 202 in answers, sorted(set(answers))

        assert wait_for(lambda: peer_threads() <= peers0, timeout=20), (peer_threads(), peers0)
        assert wait_for(lambda: fds() <= fds0 + 4, timeout=20), (fds(), fds0)
        with capsys.disabled():
            print(f"\nflood: threads {threads0} -> peak {peak_threads} -> {threading.active_count()}; "
                  f"fds {fds0} -> peak {peak_fds} -> {fds()}; peer threads {peers0} -> {peer_threads()}; "
                  f"phase-2 answers: {answers.count(202)} x 202, {answers.count(429)} x 429")
