# SPDX-License-Identifier: Apache-2.0
"""A video encoded in chunks of whole temporal groups equals the video encoded whole.

Every Qwen tower attends within one frame (Qwen2.5-VL: within one frame's
windows), and its positions (rotary tables, Qwen3-VL's interpolated position
embedding) depend on (h, w) only, repeated over t. So chunk ``[a, b)``, the
rows ``[a*h*w, b*h*w)`` with grid ``(b-a, h, w)``, computes what the whole
video computes for those rows; only GEMM row counts differ, which moves the
last bits (within 1e-5 in fp32). Under ``batch_invariant`` the unit is one
temporal group, so the whole video and its chunks, packed with anything, run
the same per-group forwards: bitwise equal by construction.
"""

from __future__ import annotations

import pytest
import torch

from epd_encoder.models.invariant import batch_invariant
from epd_encoder.models.registry import load_vision_model
from epd_encoder.models.tiny import FAMILIES, write_tiny_model

QWEN = [f for f in FAMILIES if f.startswith("qwen")]
GRID = (5, 8, 12)  # t, h, w in patches: Qwen2.5-VL's 8-patch windows tile each frame 1 x 2 (partial)
CHUNKS = [(0, 1), (1, 3), (3, 5)]  # whole temporal groups, uneven on purpose


@pytest.fixture(scope="module", params=QWEN)
def towers(request, tmp_path_factory):
    d = write_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "m")
    return {kind: load_vision_model(d, tower=kind, progress=False).tower for kind in ("fast", "reference")}


def pixels_for(towers) -> torch.Tensor:
    """Synthetic patch rows ``[t*h*w, C*T*P*P]``, seeded."""
    t, h, w = GRID
    width = towers["fast"].patch_embed.proj.weight[0].numel()
    return torch.randn(t * h * w, width, generator=torch.Generator().manual_seed(3))


def chunk(pixels: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Rows of temporal groups [a, b), t-major, and their grid."""
    _, h, w = GRID
    return pixels[a * h * w:b * h * w], (b - a, h, w)


def run(tower, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
    with torch.no_grad():
        return tower.forward_packed(pixels, torch.tensor(grids))


def by_chunk(tower, pixels: torch.Tensor):
    """Each chunk in its own forward, outputs concatenated in order."""
    parts = []
    for a, b in CHUNKS:
        rows, grid = chunk(pixels, a, b)
        parts.append(run(tower, rows, [grid]))
    rows = torch.cat([p[0] for p in parts])
    deep = None if parts[0][1] is None else [torch.cat([p[1][j] for p in parts]) for j in range(len(parts[0][1]))]
    return rows, deep


@pytest.mark.parametrize("kind", ["fast", "reference"])
def test_chunks_equal_the_whole_video(towers, kind):
    tower = towers[kind]
    pixels = pixels_for(towers)
    whole, whole_deep = run(tower, pixels, [GRID])
    rows, deep = by_chunk(tower, pixels)
    # The tiny random towers barely depend on positions (Qwen2-VL: a transposed grid moves the
    # output by only ~3e-6), so 1e-5 alone could miss a position error: the chunks must also be
    # well below what the same rows under a wrong (h, w) give.
    t, h, w = GRID
    wrong, _ = run(tower, pixels, [(t, w, h)])
    tol = min(1e-5, (wrong - whole).abs().max().item() / 8)
    assert rows.shape == whole.shape == (tower.tokens_for_grid(GRID), whole.shape[1])
    assert (rows - whole).abs().max().item() <= tol
    assert (whole_deep is None) == (deep is None)
    if deep is not None:
        assert len(deep) == len(whole_deep) > 0
        for d, ww in zip(deep, whole_deep):
            assert (d - ww).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["fast", "reference"])
def test_batch_invariant_chunks_are_bitwise_the_whole_video(towers, kind):
    tower = towers[kind]
    pixels = pixels_for(towers)
    grids = [chunk(pixels, a, b)[1] for a, b in CHUNKS]
    with batch_invariant(tower):
        whole, whole_deep = run(tower, pixels, [GRID])
        alone, alone_deep = by_chunk(tower, pixels)
        packed, packed_deep = run(tower, pixels, grids)  # all chunks in one packed call
    assert torch.equal(packed, alone) and torch.equal(packed, whole)
    if alone_deep is not None:
        assert all(torch.equal(p, q) and torch.equal(p, w) for p, q, w in zip(packed_deep, alone_deep, whole_deep))
