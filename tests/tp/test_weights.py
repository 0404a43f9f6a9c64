# SPDX-License-Identifier: Apache-2.0
"""Weights mode with real rank processes (gloo on loopback): equality with one executor
(1e-5) for every family shape (windowed Qwen, deepstack, InternVL tiles), per-unit
batch invariance, the per-rank shard, and failure: a forward that raises, hangs or
is killed on one rank, and a rank killed while idle, each a ``RankFailed`` within seconds;
a row count that disagrees after a forward every rank finished fails that batch only."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil
import pytest
import torch

import epd_encoder.tp.weights as tp_weights
from epd_encoder.errors import ConfigError, EncodeFailed, OutputMismatch, RankFailed
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.tp import layers
from epd_encoder.tp.data import ExecutorSpec
from epd_encoder.tp.weights import TPWeightsExecutor, WeightsRank
from epd_encoder.types import PreprocessedImage
from tests.tp.test_data import assert_outputs, reference
from tests.tp.test_group import call_in_thread, gone, until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rank groups need Linux's prctl")
HERE = "tests.tp.test_weights"


# -- a rank whose forward breaks after its first all-reduce (built in the rank process) -----
def make_faulty(rank, size, fault, marker="", **spec):
    handler = WeightsRank(rank, size, ExecutorSpec(**spec))
    real, calls = layers.all_reduce_, [0]

    def all_reduce_(t, group):
        calls[0] += 1
        if calls[0] == 2:  # inside forward_packed, rank 0 already in its second all-reduce
            if marker:
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
            if fault == "raise":
                raise RuntimeError("injected fault in rank 1's forward")
            threading.Event().wait()  # "hang"
        return real(t, group)

    layers.all_reduce_ = all_reduce_  # RowParallelLinear looks it up at call time
    return handler


POISON = [3, 4, 8]  # items_for's last grid


def short_rows(forward):
    """``forward`` that returns one row too few for any batch holding the ``POISON`` grid."""
    def short(pixels, grid):
        emb, deep = forward(pixels, grid)
        return (emb[:-1], deep) if POISON in grid.tolist() else (emb, deep)
    return short


def make_short(rank, size, **spec):
    """A rank whose forward completes every collective, then returns a row short."""
    handler = WeightsRank(rank, size, ExecutorSpec(**spec))
    handler._forward = short_rows(handler._forward)
    return handler


# -- inputs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-weights")
    return {f: str(write_tiny_model(f, root / f)) for f in ("qwen2_5_vl", "qwen3_vl", "internvl")}


def items_for(tower, family, seed=0) -> list[PreprocessedImage]:
    """A mixed batch: images of several sizes and a video (t > 1; InternVL: two frames as tiles)."""
    gen = torch.Generator().manual_seed(seed)
    if family == "internvl":
        side, px = tower.vision_tower.embeddings.grid[0], 448
        grids = [(2, side, side), (1, side, side)]
        return [PreprocessedImage(torch.randn(t, 3, px, px, generator=gen), g, tower.tokens_for_grid(g))
                for g in grids for t in [g[0]]]
    width = tower.patch_embed.proj.weight[0].numel()
    # 12x16 patches: Qwen2.5-VL's 4x4-unit windows are partly short.
    grids = [(1, 12, 16), (2, 8, 8), (1, 4, 4), (3, 4, 8)]
    return [PreprocessedImage(torch.randn(t * h * w, width, generator=gen), (t, h, w), tower.tokens_for_grid((t, h, w)))
            for t, h, w in grids]


# -- equality and the shard ---------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl"])
def test_weights_mode_equals_one_executor(checkpoints, family):
    spec = ExecutorSpec(checkpoints[family])
    with TPWeightsExecutor(spec, 2) as tp:
        items = items_for(tp.tower, family)
        batches = [items, items[::-1], items[1:2]]  # several batches in a row, other packings
        got = [tp.encode(b) for b in batches]
        threads, digest = tp.group.threads, tp.model.weights_digest
        # Malformed pixels are refused before anything is sent; the group carries on.
        bad = PreprocessedImage(items[0].pixel_values[..., :-2].contiguous(), items[0].grid_thw, items[0].num_tokens)
        with pytest.raises(EncodeFailed, match="do not fit"):
            tp.encode([items[1], bad])
        assert tp.group.failure is None
        assert_outputs(tp.encode(items[:1]), reference(spec, items[:1], threads), bitwise=False)
        held = sum(p.numel() for p in tp.tower.parameters())
        stats = tp.stats
    assert tp.group.exitcodes == [0]
    for batch, out in zip(batches, got):
        assert_outputs(out, reference(spec, batch, threads), bitwise=False)
    if family == "qwen3_vl":
        assert got[0][0].deepstack
    # Rank 0 holds exactly its planned shard: half of the blocks (their norms and output
    # biases whole), and read only that much of the checkpoint.
    assert held == stats.per_rank[0] < stats.total
    assert 0.5 <= stats.block_fraction < 0.56, stats
    assert tp.weight_bytes == held * 4  # the tiny checkpoints are fp32
    # One identity for the whole tower (all ranks' shard digests), not rank 0's shard.
    assert len(digest) == 64 and not digest.startswith("tp2r0:")


def test_batch_invariant_units_are_independent_of_the_batch(checkpoints):
    spec = ExecutorSpec(checkpoints["qwen2_5_vl"], batch_invariant=True)
    with TPWeightsExecutor(spec, 2) as tp:
        items = items_for(tp.tower, "qwen2_5_vl")
        together = tp.encode(items)
        alone = [tp.encode([it])[0] for it in items]
        reordered = tp.encode(items[::-1])[::-1]
        threads = tp.group.threads
    assert_outputs(together, alone, bitwise=True)
    assert_outputs(reordered, alone, bitwise=True)
    assert_outputs(together, reference(spec, items, threads), bitwise=False)  # TP1 within tolerance


def test_a_head_count_size_does_not_divide_is_a_config_error_before_any_rank(checkpoints, monkeypatch):
    import subprocess

    def no_spawn(*a, **k):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    with pytest.raises(ConfigError, match="not divisible by tensor parallel size 3"):
        TPWeightsExecutor(ExecutorSpec(checkpoints["qwen2_5_vl"]), 3)  # the tiny towers have 2 heads


# -- failure -------------------------------------------------------------------------------
def faulty(checkpoints, fault, marker="", **kw) -> TPWeightsExecutor:
    tp = TPWeightsExecutor(ExecutorSpec(checkpoints["qwen2_5_vl"]), 2, **kw)
    tp.group._factory = f"{HERE}:make_faulty"
    tp.group._args.update(fault=fault, marker=marker)
    return tp.start()


def test_a_forward_raising_on_one_rank_is_fatal_within_seconds(checkpoints):
    failed = threading.Event()
    tp = faulty(checkpoints, "raise", on_failure=lambda e: failed.set())
    try:
        items = items_for(tp.tower, "qwen2_5_vl")
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match="injected fault"):  # the rank's last word, via rank 0
            tp.encode(items)
        assert time.monotonic() - t0 < 5.0  # the closed socket, not the 30 s timeout
        assert failed.is_set()
        with pytest.raises(RankFailed):
            tp.encode(items)
    finally:
        tp.close()


def test_a_rank_hung_in_its_forward_fails_at_the_collective_timeout(checkpoints):
    tp = faulty(checkpoints, "hang", timeout_s=3.0, heartbeat_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(RankFailed):
            tp.encode(items_for(tp.tower, "qwen2_5_vl"))
        assert 2.5 < time.monotonic() - t0 < 3.0 + 5.0
        until(lambda: all(gone(p) for p in tp.group.pids), 5.0, "the hung rank is killed")
    finally:
        tp.close()


def test_a_rank_killed_during_a_forward_fails_the_call_not_hangs(checkpoints, tmp_path):
    marker = tmp_path / "in-forward"
    tp = faulty(checkpoints, "hang", str(marker), timeout_s=60.0)
    try:
        items = items_for(tp.tower, "qwen2_5_vl")
        done, box = call_in_thread(lambda: tp.encode(items))
        until(marker.exists, 10.0, "rank 1 in its forward")
        os.kill(int(marker.read_text()), signal.SIGKILL)
        assert done.wait(5.0), "rank 0 still waits on a dead rank"
        assert isinstance(box.get("error"), RankFailed) and "SIGKILL" in str(box["error"]), box
    finally:
        tp.close()


def test_an_idle_group_is_idle_and_a_rank_killed_while_idle_fails_it(checkpoints):
    failed = threading.Event()
    with TPWeightsExecutor(ExecutorSpec(checkpoints["qwen2_5_vl"]), 2, heartbeat_s=0.5,
                           on_failure=lambda e: failed.set()) as tp:
        items = items_for(tp.tower, "qwen2_5_vl")
        tp.encode(items)
        rank, ours = psutil.Process(tp.group.pids[0]), psutil.Process()
        c0, t0, start = sum(ours.cpu_times()[:2]) + sum(rank.cpu_times()[:2]), time.monotonic(), tp.group.heartbeats
        until(lambda: tp.group.heartbeats >= start + 3, 10.0, "three heartbeats")
        cpu = sum(ours.cpu_times()[:2]) + sum(rank.cpu_times()[:2]) - c0
        assert cpu / (time.monotonic() - t0) < 0.10, f"idle weights-mode group used {cpu:.3f} s of CPU"
        os.kill(tp.group.pids[0], signal.SIGKILL)
        assert failed.wait(5.0), "the watchdog did not notice a dead rank"
        with pytest.raises(RankFailed, match="rank 1 .*SIGKILL"):
            tp.encode(items)


def check_batch_failed_alone(tp, items, match):
    """The batch holding the poison fails with ``OutputMismatch``; the group carries on."""
    with pytest.raises(OutputMismatch, match=match):
        tp.encode(items)
    assert tp.group.failure is None and tp.group.exitcodes == [None]
    clean = [it for it in items if list(it.grid_thw) != POISON]
    assert_outputs(tp.encode(clean), reference(tp.spec, clean, tp.group.threads), bitwise=False)


def test_a_row_count_that_disagrees_on_rank_0_fails_that_batch_only(checkpoints, monkeypatch):
    real = tp_weights.load_shard

    def load(spec, rank, size):  # rank 0 only: this process's shard
        model, report = real(spec, rank, size)
        model.tower.forward_packed = short_rows(model.tower.forward_packed)
        return model, report

    monkeypatch.setattr(tp_weights, "load_shard", load)
    with TPWeightsExecutor(ExecutorSpec(checkpoints["qwen2_5_vl"]), 2) as tp:
        check_batch_failed_alone(tp, items_for(tp.tower, "qwen2_5_vl"), "rank 0: tower returned")
    assert tp.group.exitcodes == [0]


def test_a_row_count_that_disagrees_on_another_rank_fails_that_batch_only(checkpoints):
    tp = TPWeightsExecutor(ExecutorSpec(checkpoints["qwen2_5_vl"]), 2)
    tp.group._factory = f"{HERE}:make_short"
    with tp:  # starts the group
        check_batch_failed_alone(tp, items_for(tp.tower, "qwen2_5_vl"), "rank 1: its output rows disagree")
    assert tp.group.exitcodes == [0]
