# SPDX-License-Identifier: Apache-2.0
"""Data mode with real rank processes: LPT shares, equality with one executor
(1e-5; bitwise with batch_invariant), a forward failing on one rank only."""

from __future__ import annotations

import sys

import pytest
import torch

from epd_encoder.errors import EncodeFailed
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.tp.data import ExecutorSpec, TPExecutor, lpt_assign
from epd_encoder.types import PreprocessedImage

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rank groups need Linux's prctl")

# Images of several sizes and videos (t > 1): whole items, so a video never splits.
GRIDS = [(1, 4, 4), (1, 8, 6), (3, 4, 4), (1, 2, 2), (2, 6, 8), (1, 10, 4)]


# -- the assignment (pure) ---------------------------------------------------------------
def test_lpt_places_every_item_once_largest_first_on_the_least_loaded():
    shares = lpt_assign([5, 9, 2, 7, 4, 4], 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    # 9 -> r1 (tie: highest rank), 7 -> r0, 5 -> r0 (7 < 9), 4 -> r1 (9 < 12), 4 -> r0 (12 < 13),
    # 2 -> r1 (13 < 16): loads 16 / 15, each share in item order.
    loads = [sum([5, 9, 2, 7, 4, 4][i] for i in s) for s in shares]
    assert shares == [[0, 3, 5], [1, 2, 4]] and loads == [16, 15]


def test_lpt_is_deterministic_and_bounded():
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        n, ranks = int(torch.randint(0, 20, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        costs = torch.randint(1, 1000, (n,), generator=gen).tolist()
        shares = lpt_assign(costs, ranks)
        assert shares == lpt_assign(list(costs), ranks)
        assert sorted(i for s in shares for i in s) == list(range(n))
        loads = [sum(costs[i] for i in s) for s in shares]
        # LPT: the most loaded rank exceeds the mean by at most one item's cost.
        assert max(loads) <= sum(costs) / ranks + (max(costs) if costs else 0)


def test_lpt_leaves_rank_0_last_on_ties():
    assert lpt_assign([3], 3) == [[], [], [0]]


# -- real ranks ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-data")
    return {f: str(write_tiny_model(f, root / f)) for f in ("qwen2_5_vl", "qwen3_vl")}


def items_for(executor, grids, seed=0) -> list[PreprocessedImage]:
    width = executor.tower.patch_embed.proj.weight[0].numel()
    gen = torch.Generator().manual_seed(seed)
    return [PreprocessedImage(torch.randn(t * h * w, width, generator=gen), (t, h, w),
                              executor.tower.tokens_for_grid((t, h, w))) for t, h, w in grids]


def reference(spec, items, threads):
    """``--tp 1``: one executor, the whole batch in one call, at the ranks' thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return spec.build().encode(items)
    finally:
        torch.set_num_threads(before)


def assert_outputs(got, want, *, bitwise: bool):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        pairs = [(g.embedding, w.embedding)]
        assert (g.deepstack is None) == (w.deepstack is None)
        pairs += list(zip(g.deepstack or (), w.deepstack or ()))
        for a, b in pairs:
            assert a.shape == b.shape and a.dtype == b.dtype
            if bitwise:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family,size", [("qwen2_5_vl", 2), ("qwen2_5_vl", 3), ("qwen3_vl", 2)])
@pytest.mark.parametrize("invariant", [False, True], ids=["packed", "batch_invariant"])
def test_data_mode_equals_one_executor(checkpoints, family, size, invariant):
    spec = ExecutorSpec(checkpoints[family], batch_invariant=invariant)
    with TPExecutor(spec, size) as tp:
        items = items_for(tp.local, GRIDS)
        got = tp.encode(items)
        again = tp.encode(items[::-1])[::-1]  # other shares, same outputs
        single = tp.encode(items[2:3])  # fewer items than ranks: empty shares
        threads = tp.group.threads
    assert tp.group.exitcodes == [0] * (size - 1)
    want = reference(spec, items, threads)
    assert_outputs(got, want, bitwise=invariant)
    assert_outputs(again, want, bitwise=invariant)
    assert_outputs(single, want[2:3], bitwise=invariant)
    if family == "qwen3_vl":
        assert got[0].deepstack


def test_a_forward_failing_on_one_rank_fails_the_batch_only(checkpoints):
    spec = ExecutorSpec(checkpoints["qwen2_5_vl"])
    with TPExecutor(spec, 2) as tp:
        items = items_for(tp.local, [(1, 4, 4), (1, 8, 8)])
        # The largest item goes to rank 1: give it pixel rows of the wrong width.
        bad = PreprocessedImage(items[1].pixel_values[:, :-2].contiguous(), items[1].grid_thw, items[1].num_tokens)
        with pytest.raises(EncodeFailed, match="rank 1"):
            tp.encode([items[0], bad])
        assert tp.group.failure is None
        assert_outputs(tp.encode(items), reference(spec, items, tp.group.threads), bitwise=False)
    assert tp.group.exitcodes == [0]
