# SPDX-License-Identifier: Apache-2.0
"""Determinism of ``--tp 2`` under adversarial load (issue 12, section 3), both modes.

A real server (uvicorn on loopback, rank 0 in this process, rank 1 a real gloo process)
takes a seeded random interleaving of waves, a fixed budget of operations in all:

- mixed waves, run concurrently from a barrier: fresh images, duplicates within the wave
  (coalesced or hit), repeats of earlier images (cache hits), oversize images (413), and
  poison images whose forward fails on rank 1 only (``tests/tp/adversarial.py``): that
  batch fails (500 ``encode_failed``), the group and every later batch carry on;
- held waves: the engine is held, requests are accepted, some clients disconnect (499,
  cancelled) and the rest run out the short ``request_timeout`` (504); then it is released.

Then: both ranks recorded the same digest sequence (each rank writes the digest of the batch
it formed before the all-gather compares them); every request got exactly one answer or a disconnect, and the
server's ``epd_requests_total`` by status says the same; nothing is left in flight (engine
ledger, queue, pending cost, cache pins, decoded bytes); the same image always got the same
bits (``--batch-invariant``); and the server still computes what it computed before.

Weights mode runs the same storm without poison (a one-rank fault is fatal to a
weights-mode group by design), then a last wave with one: every request of it ends once,
and the server turns unhealthy. The digests are over the batches every rank formed by
replaying rank 0's scheduler calls (``tp/replica.py``).
"""

from __future__ import annotations

import io
import json
import random
import socket
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field, replace

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

import epd_encoder.tp.data as tp_data
import epd_encoder.tp.group as tp_group
import epd_encoder.tp.weights as tp_weights
from epd_encoder.config import LimitsConfig, TPConfig
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, b64, metric, png, scrape, serve_config, wait_for
from tests.tp.adversarial import recording

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rank groups need Linux's prctl")

SEED, BUDGET = 12, 60
SIZES = [(32, 32), (64, 64), (96, 64), (64, 96), (112, 112)]  # costs 16..64 patches
POISON, POISON_GRID = (160, 160), [1, 12, 12]  # 144 patches: the largest item, so LPT hands it to rank 1
OVERSIZE = (300, 300)  # ~270 KB of noise PNG
MAX_IMAGE_BYTES = 100_000  # the poison (~77 KB) fits
TIMEOUT_S = 3.0  # the request timeout: a held wave costs this once
ROUTE = "/v1/encode"


@dataclass
class Op:
    kind: str  # fresh, dup, repeat, poison, oversize | timeout, disconnect
    rid: str
    image: int  # the image's id (seed); equal ids are equal bytes
    size: tuple[int, int]
    status: int | None = None
    answers: int = 0
    embedding: torch.Tensor | None = field(default=None, repr=False)


def plan(rng: random.Random, budget: int, poison: bool = True) -> list[tuple[str, list[Op]]]:
    """Waves of ops, from the seed alone (repeats draw only on images of poison-free waves,
    which all succeed: asserted)."""
    waves: list[tuple[str, list[Op]]] = []
    safe: list[tuple[int, tuple[int, int]]] = []  # images known to be encoded and cached
    n = 0
    while n < budget:
        ops: list[Op] = []

        def op(kind: str, image: int | None = None, size: tuple[int, int] | None = None) -> Op:
            image = image if image is not None else 1000 + n + len(ops)
            o = Op(kind, f"r{n + len(ops)}-{kind}", image, size or rng.choice(SIZES))
            ops.append(o)
            return o

        if rng.random() < 0.25:
            for _ in range(rng.randint(1, 2)):
                op("timeout")
            for _ in range(rng.randint(1, 2)):
                op("disconnect")
            waves.append(("held", ops))
        else:
            for _ in range(rng.randint(2, 6)):
                kind = rng.choices(["fresh", "dup", "repeat", "poison", "oversize"], [4, 2, 2, 1.5 * poison, 1])[0]
                mine = [o for o in ops if o.kind in ("fresh", "dup", "repeat")]
                if kind == "dup" and mine:
                    src = rng.choice(mine)
                    op("dup", src.image, src.size)
                elif kind == "repeat" and safe:
                    image, size = rng.choice(safe)
                    op("repeat", image, size)
                elif kind == "poison":
                    op("poison", size=POISON)
                elif kind == "oversize":
                    op("oversize", size=OVERSIZE)
                else:
                    op("fresh")
            if not any(o.kind == "poison" for o in ops):
                safe += [(o.image, o.size) for o in ops if o.kind != "oversize"]
            waves.append(("mixed", ops))
        n += len(ops)
    return waves


def body(o: Op) -> dict:
    return {"request_id": o.rid, "items": [{"type": "image", "image": b64(png(o.image, o.size))}]}


def post(url: str, o: Op, start: threading.Barrier | None = None) -> None:
    if start is not None:
        start.wait(30)
    r = httpx.post(f"{url}{ROUTE}", json=body(o), timeout=30)
    o.status, o.answers = r.status_code, o.answers + 1
    if r.status_code == 200:
        [(_, out)] = unpack_inline(r.content)[1]
        o.embedding = out.embedding
    else:
        o.embedding = r.json()["error"]["code"]  # type: ignore[assignment]


def raw_request(url: str, o: Op) -> socket.socket:
    """The request sent in full on a plain socket, left open (closed by the test: a disconnect)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body(o)).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def twin_png(seed: int, size: tuple[int, int]) -> bytes:
    """``png(seed, size)``'s pixels in other bytes (another compression level): another key, a miss."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def encode_one(client: httpx.Client, data: bytes):
    r = client.post(ROUTE, json={"items": [{"type": "image", "image": b64(data)}]})
    assert r.status_code == 200, r.text
    [(meta, out)] = unpack_inline(r.content)[1]
    return meta, out.embedding


def start_tp_server(mode: str, tiny_dir, tmp_path, monkeypatch):
    """``--tp 2 --tp-mode MODE --batch-invariant`` whose rank 1 is ``tests.tp.adversarial``'s."""
    records = {0: tmp_path / "rank0.digests", 1: tmp_path / "rank1.digests"}
    module = tp_data if mode == "data" else tp_weights
    real_group = module.RankGroup
    hooked = {"data": "tests.tp.adversarial:make_rank", "weights": "tests.tp.adversarial:make_weights_rank"}[mode]

    def group(size, factory, args, **kw):
        assert factory == f"epd_encoder.tp.{mode}:make_{mode}_rank"
        return real_group(size, hooked, {**args, "record": str(records[1]), "poison": POISON_GRID}, **kw)

    monkeypatch.setattr(module, "RankGroup", group)
    monkeypatch.setattr(tp_group, "agree", recording(str(records[0])))
    base = serve_config(tiny_dir)
    config = replace(base, parallel=TPConfig(tp=2, tp_mode=mode), request_timeout=TIMEOUT_S,
                     model=replace(base.model, batch_invariant=True),
                     limits=replace(LimitsConfig(), max_image_bytes=MAX_IMAGE_BYTES))
    server = Server(config).start()
    assert wait_for(lambda: server.runtime.ready, 60), "the TP server never became ready"
    return server, records


@pytest.fixture
def tp_server(tiny_dir, tmp_path, monkeypatch):
    server, records = start_tp_server("data", tiny_dir, tmp_path, monkeypatch)
    try:
        yield server, records
    finally:
        group_ = server.runtime.executor.group if server.runtime else None
        server.stop()
        if group_ is not None:
            assert group_.exitcodes == [0], group_.exitcodes  # rank 1 left on Shutdown


def run_mixed(url: str, ops: list[Op]) -> None:
    start = threading.Barrier(len(ops))
    threads = [threading.Thread(target=post, args=(url, o, start)) for o in ops]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a request got no answer"


def cancelled(client: httpx.Client) -> float:
    return scrape(client).get(("epd_requests_total", frozenset({("route", ROUTE), ("status", "499")})), 0.0)


def run_held(server: Server, client: httpx.Client, ops: list[Op]) -> None:
    """Every op accepted while the engine is held; disconnects close, the rest time out."""
    engine = server.runtime.engine
    assert engine.active_requests == 0
    was = cancelled(client)
    with server.paused_engine():
        waiting = [o for o in ops if o.kind == "timeout"]
        threads = [threading.Thread(target=post, args=(server.url, o)) for o in waiting]
        for t in threads:
            t.start()
        sockets = [raw_request(server.url, o) for o in ops if o.kind == "disconnect"]
        assert wait_for(lambda: engine.active_requests == len(ops), 20), "the held wave was not accepted"
        for s in sockets:
            s.close()  # mid-request: accepted, queued behind the held engine
        for o in ops:
            if o.kind == "disconnect":
                o.answers, o.status = o.answers + 1, 499  # the client's terminal state: it left
        # The server noticed and answered each disconnect while the engine was still held.
        gone = len(ops) - len(waiting)
        assert wait_for(lambda: cancelled(client) - was == gone, 20), "a disconnect was not cancelled"
        for t in threads:
            t.join(TIMEOUT_S + 20)
            assert not t.is_alive(), "a timed-out request got no answer"
    assert wait_for(lambda: engine.active_requests == 0, 20), "the held wave left requests behind"


def run_storm(server: Server, client: httpx.Client, waves: list[tuple[str, list[Op]]]) -> list[Op]:
    ops = [o for _, w in waves for o in w]
    for kind, wave in waves:
        if kind == "held":
            run_held(server, client, wave)
        else:
            run_mixed(server.url, wave)
    return ops


def status_count(snapshot: dict, status: int) -> float:
    return snapshot.get(("epd_requests_total", frozenset({("route", ROUTE), ("status", str(status))})), 0.0)


def check_one_terminal_state_each(ops: list[Op], baseline: dict, after: dict) -> Counter:
    """Every request got exactly one answer, and the server counted the same by status."""
    assert all(o.answers == 1 for o in ops), [o for o in ops if o.answers != 1]
    statuses = Counter(o.status for o in ops)
    for status in (200, 413, 499, 500, 503, 504):
        assert status_count(after, status) - status_count(baseline, status) == statuses[status], status
    return statuses


def check_nothing_left(server: Server, client: httpx.Client) -> None:
    """The engine's ledger, the queue, pins and the decode budget are back at zero."""
    rt = server.runtime
    idle = {"epd_pending_cost_patches": 0, "epd_queued_items": 0, "epd_cache_pinned_entries": 0,
            "epd_cache_pinned_bytes": 0, "epd_decoded_bytes": 0}

    def drained() -> bool:
        s = scrape(client)
        return rt.engine.active_requests == 0 and all(metric(s, k) == v for k, v in idle.items())

    assert wait_for(drained, 20), ({k: metric(client, k) for k in idle}, rt.engine.active_requests)


def check_digests(records: dict) -> list[str]:
    """Both ranks formed the same digest sequence, every batch, none skipped (each rank's list
    is written before the ranks compare: a batch they disagreed on is in both, differing)."""
    lines = {r: p.read_text().splitlines() for r, p in records.items()}
    assert lines[0] == lines[1], "the ranks agreed to different digest sequences"
    seqs = [int(line.split()[0]) for line in lines[0]]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 2, seqs
    assert len({line.split()[1] for line in lines[0]}) > 1
    return lines[0]


def test_check_digests_fails_when_the_ranks_formed_different_batches(tmp_path, monkeypatch):
    """The check itself: two batches agreed, then rank 1 forms another third batch."""
    from epd_encoder.errors import RankMismatch
    from tests.tp.test_group import work

    records = {0: tmp_path / "rank0.digests", 1: tmp_path / "rank1.digests"}
    monkeypatch.setattr(tp_group, "agree", recording(str(records[0])))
    group = tp_group.RankGroup(2, "tests.tp.adversarial:make_late_liar",
                               {"record": str(records[1]), "from_seq": 3}).start()
    try:
        for n in (1, 2):
            group.run(work(n), lambda w: None)
        with pytest.raises(RankMismatch):
            group.run(work(3), lambda w: None)
    finally:
        group.close()
    with pytest.raises(AssertionError, match="different digest sequences"):
        check_digests(records)


def check_same_bits(ops: list[Op]) -> None:
    for image in {o.image for o in ops if o.status == 200}:
        got = [o.embedding for o in ops if o.image == image and o.status == 200]
        assert all(torch.equal(g, got[0]) for g in got), f"image {image} got different bits"


def test_tp2_data_mode_stays_deterministic_under_adversarial_load(tp_server):
    server, records = tp_server
    client = httpx.Client(base_url=server.url, timeout=30)
    before_meta, before = encode_one(client, png(7, (112, 112)))
    assert before_meta.cache == "miss"
    baseline = scrape(client)

    waves = plan(random.Random(SEED), BUDGET)
    ops = run_storm(server, client, waves)
    kinds = Counter(o.kind for o in ops)
    assert len(ops) >= BUDGET and all(kinds[k] for k in ("fresh", "dup", "repeat", "poison", "oversize",
                                                          "timeout", "disconnect")), kinds

    # -- every request reached exactly one terminal state, on both sides -------------------
    for kind, wave in waves:
        poisoned = any(o.kind == "poison" for o in wave)
        for o in wave:
            want = {"oversize": {413}, "poison": {500}, "timeout": {504}, "disconnect": {499},
                    "repeat": {200}}.get(o.kind, {200, 500} if poisoned else {200})
            assert o.status in want, (kind, o)
            if o.status == 500:
                assert o.embedding == "encode_failed", o
    after = scrape(client)
    statuses = check_one_terminal_state_each(ops, baseline, after)
    assert statuses[500] >= kinds["poison"] and statuses[200] > len(ops) // 3, statuses
    # Repeats hit the cache; of each duplicate pair of a poison-free wave one coalesced or hit.
    shared = kinds["repeat"] + sum(1 for kind, w in waves for o in w
                                   if o.kind == "dup" and not any(p.kind == "poison" for p in w))
    reused = sum(after.get(("epd_items_total", frozenset({("cache", c)})), 0.0)
                 - baseline.get(("epd_items_total", frozenset({("cache", c)})), 0.0) for c in ("hit", "coalesced"))
    assert reused >= shared, (reused, shared)
    check_nothing_left(server, client)

    # -- every batch digest matched on every rank, in the same sequence --------------------
    group = server.runtime.executor.group
    assert group.failure is None and group.exitcodes == [None]
    # The digests cover the batches each rank formed by replaying the scheduler's calls.
    assert group.log is not None and len(group.log) == 0
    check_digests(records)

    # -- determinism and health after the storm --------------------------------------------
    check_same_bits(ops)
    assert client.get("/health").status_code == 200
    meta, again = encode_one(client, twin_png(7, (112, 112)))
    assert meta.cache == "miss" and torch.equal(again, before), "the server computes other bits after the storm"
    client.close()


def test_tp2_weights_mode_stays_deterministic_then_fails_whole_on_a_one_rank_fault(tiny_dir, tmp_path, monkeypatch):
    """Weights mode: the same storm without poison, then a last wave whose poison fails on
    rank 1 only. That is fatal to the group by design (the ranks are mid-collective): every
    request of the wave still ends exactly once (200 if batched before, else 503
    ``rank_failed``), and the server turns unhealthy."""
    server, records = start_tp_server("weights", tiny_dir, tmp_path, monkeypatch)
    try:
        client = httpx.Client(base_url=server.url, timeout=30)
        baseline = scrape(client)
        waves = plan(random.Random(SEED + 1), BUDGET // 2, poison=False)
        ops = run_storm(server, client, waves)
        kinds = Counter(o.kind for o in ops)
        assert all(kinds[k] for k in ("fresh", "dup", "oversize", "timeout", "disconnect")), kinds
        for o in ops:
            want = {"oversize": {413}, "timeout": {504}, "disconnect": {499}}.get(o.kind, {200})
            assert o.status in want, o
        check_one_terminal_state_each(ops, baseline, scrape(client))
        check_nothing_left(server, client)
        check_same_bits(ops)
        agreed = check_digests(records)

        # The fault: the poison and fresh images in one concurrent wave.
        last = [Op("poison", "last-poison", 9000, POISON)] + [Op("fresh", f"last-{i}", 9001 + i, SIZES[i])
                                                              for i in range(3)]
        mid = scrape(client)
        run_mixed(server.url, last)
        group = server.runtime.executor.group
        assert wait_for(lambda: group.failure is not None, 20), "the group did not fail"
        assert last[0].status == 503 and last[0].embedding == "rank_failed", last[0]
        assert all(o.status in (200, 503) for o in last), last
        check_one_terminal_state_each(last, mid, scrape(client))
        assert wait_for(lambda: server.runtime.engine.active_requests == 0, 20)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "rank_failed", health.text
        # Up to the fault, both ranks formed every batch alike (the poison's batch included).
        lines = check_digests(records)
        assert lines[:len(agreed)] == agreed and len(lines) > len(agreed)
        assert wait_for(lambda: group.exitcodes[0] is not None, 10) and group.exitcodes[0] != 0
        client.close()
    finally:
        server.stop()
