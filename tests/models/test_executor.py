# SPDX-License-Identifier: Apache-2.0
"""VisionExecutor: one forward per batch, per-item split, token-count checks."""

from __future__ import annotations

import math

import pytest
import torch

from epd_encoder.errors import EncodeFailed, OutputMismatch
from epd_encoder.models.towers import qwen2_5_vl, qwen3_vl
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.tiny import tiny_config
from epd_encoder.types import ItemOutput, PreprocessedImage
from tests.models.towers.test_qwen2_vl import ATOL_BATCH, build_pair, max_diff, random_pixels

GRIDS = [(1, 8, 12), (1, 4, 4), (1, 22, 18), (2, 6, 10)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


class Counting:
    """Wraps a tower and counts forwards."""

    def __init__(self, tower, rows_delta: int = 0, fail: Exception | None = None) -> None:
        self.tower, self.calls, self.rows_delta, self.fail = tower, 0, rows_delta, fail

    def tokens_for_grid(self, grid):
        return self.tower.tokens_for_grid(grid)

    def forward_packed(self, pixels, grid_thw):
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        emb, deep = self.tower.forward_packed(pixels, grid_thw)
        return emb[: emb.shape[0] + self.rows_delta] if self.rows_delta else emb, deep


def items_for(config, tower, grids, seed=1):
    pixels = random_pixels(config, grids, seed=seed)
    out, start = [], 0
    for g in grids:
        n = math.prod(g)
        out.append(PreprocessedImage(pixels[start : start + n], g, tower.tokens_for_grid(g)))
        start += n
    return out


@pytest.fixture(scope="module")
def qwen25():
    cfg = tiny_config("qwen2_5_vl")
    _, tower = build_pair(qwen2_5_vl.FAMILY, cfg)
    return cfg, tower


@pytest.fixture(scope="module")
def qwen3():
    cfg = tiny_config("qwen3_vl")
    _, tower = build_pair(qwen3_vl.FAMILY, cfg)
    return cfg, tower


def test_one_forward_and_split_equals_items_alone(qwen25):
    cfg, tower = qwen25
    counting = Counting(tower)
    ex = VisionExecutor(counting, device="cpu")
    items = items_for(cfg, tower, GRIDS)
    outs = ex.encode(items)
    assert counting.calls == 1
    assert [o.num_tokens for o in outs] == [it.num_tokens for it in items]
    for item, out in zip(items, outs):
        alone = ex.encode([item])[0]
        assert out.deepstack is None
        assert max_diff(out.embedding, alone.embedding) <= ATOL_BATCH


@pytest.mark.parametrize("grids", [GRIDS, GRIDS[:1]], ids=["batch", "single"])
def test_outputs_own_their_memory(qwen3, grids):
    cfg, tower = qwen3
    outs = VisionExecutor(tower).encode(items_for(cfg, tower, grids))
    for out in outs:
        for t in (out.embedding, *out.deepstack):
            assert t.is_contiguous()
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_deepstack_split_like_embedding(qwen3):
    cfg, tower = qwen3
    items = items_for(cfg, tower, GRIDS, seed=2)
    outs = VisionExecutor(tower).encode(items)
    with torch.inference_mode():
        emb, deep = tower.forward_packed(torch.cat([i.pixel_values for i in items]), torch.tensor(GRIDS))
    start = 0
    for out in outs:
        n = out.num_tokens
        assert isinstance(out, ItemOutput) and len(out.deepstack) == len(deep) == 2
        assert torch.equal(out.embedding, emb[start : start + n])
        for mine, full in zip(out.deepstack, deep):
            assert torch.equal(mine, full[start : start + n])
        start += n
    assert start == emb.shape[0]


def test_wrong_num_tokens_raises_before_forward(qwen25):
    cfg, tower = qwen25
    counting = Counting(tower)
    items = items_for(cfg, tower, GRIDS)
    bad = PreprocessedImage(items[1].pixel_values, items[1].grid_thw, items[1].num_tokens + 1)
    with pytest.raises(OutputMismatch, match="item 1"):
        VisionExecutor(counting).encode([items[0], bad])
    assert counting.calls == 0


def test_tower_returning_wrong_rows_raises(qwen25):
    cfg, tower = qwen25
    with pytest.raises(OutputMismatch, match="rows"):
        VisionExecutor(Counting(tower, rows_delta=-1)).encode(items_for(cfg, tower, GRIDS))


def test_forward_failure_is_encode_failed_with_cause(qwen25):
    cfg, tower = qwen25
    boom = RuntimeError("out of memory")
    with pytest.raises(EncodeFailed, match="out of memory") as info:
        VisionExecutor(Counting(tower, fail=boom)).encode(items_for(cfg, tower, GRIDS[:1]))
    assert info.value.__cause__ is boom


def test_warmup_and_empty_batch(qwen25):
    _cfg, tower = qwen25
    counting = Counting(tower)
    counting.example_item = tower.example_item
    ex = VisionExecutor(counting)
    ex.warmup()
    assert counting.calls == 1
    assert ex.encode([]) == [] and counting.calls == 1
    assert ex.dtype == torch.float32 and ex.device.type == "cpu"


def test_outputs_are_inference_free_of_grad(qwen25):
    cfg, tower = qwen25
    out = VisionExecutor(tower).encode(items_for(cfg, tower, GRIDS[:2]))[0]
    assert not out.embedding.requires_grad


@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_matches_cpu_fp32(qwen3):
    cfg, tower = qwen3
    items = items_for(cfg, tower, GRIDS)
    want = VisionExecutor(tower, device="cpu", dtype="float32").encode(items)
    import copy

    ex = VisionExecutor(copy.deepcopy(tower), device="cuda", dtype="auto")
    assert ex.dtype in (torch.bfloat16, torch.float16)
    ex.warmup()
    got = ex.encode(items)
    for g, w in zip(got, want):
        assert g.embedding.device.type == "cuda"
        scale = w.embedding.abs().max().item()
        assert max_diff(g.embedding.float().cpu(), w.embedding) <= 0.05 * scale
        for gd, wd in zip(g.deepstack, w.deepstack):
            assert max_diff(gd.float().cpu(), wd) <= 0.05 * wd.abs().max().item()


def test_upload_on_the_cpu_is_the_tensor_itself(qwen25):
    _, tower = qwen25
    ex = VisionExecutor(tower, device="cpu")
    host = torch.randn(4, 8)
    assert ex.upload(host) is host and ex._copy_stream is None


def test_cpu_encode_is_bitwise_the_towers_own_forward(qwen3):
    # The same op on the same packed input: no copy, no stream, no cast on the CPU path.
    cfg, tower = qwen3
    items = items_for(cfg, tower, GRIDS)
    outs = VisionExecutor(tower, device="cpu").encode(items)
    with torch.inference_mode():
        emb, deep = tower.forward_packed(torch.cat([it.pixel_values for it in items]), torch.tensor(GRIDS))
    counts = [it.num_tokens for it in items]
    for i, (o, e) in enumerate(zip(outs, emb.split(counts))):
        assert torch.equal(o.embedding, e)
        for od, d in zip(o.deepstack, deep):
            assert torch.equal(od, d.split(counts)[i])


@pytest.mark.gpu
@needs_cuda
def test_cuda_upload_is_ordered_before_later_compute_stream_work(qwen25):
    cfg, tower = qwen25
    import copy

    ex = VisionExecutor(copy.deepcopy(tower), device="cuda", dtype="float32")
    host = torch.arange(1 << 20, dtype=torch.float32)
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # keep the compute stream busy while the copy is issued beside it
        busy = busy @ busy / 2048
    out = ex.upload(host)
    assert out.device.type == "cuda" and not host.is_pinned()
    assert torch.equal((out + 0).cpu(), host)  # "+ 0" runs on the compute stream, after the event


@pytest.mark.gpu
@needs_cuda
def test_cuda_encode_from_host_equals_encode_from_device(qwen25):
    # Same kernels on the same values: the side-stream upload changes only where the copy runs.
    cfg, tower = qwen25
    import copy

    ex = VisionExecutor(copy.deepcopy(tower), device="cuda", dtype="float32")
    items = items_for(cfg, tower, GRIDS)
    on_device = [PreprocessedImage(it.pixel_values.cuda(), it.grid_thw, it.num_tokens) for it in items]
    for a, b in zip(ex.encode(items), ex.encode(on_device)):
        assert torch.equal(a.embedding, b.embedding)
