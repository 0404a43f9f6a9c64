# SPDX-License-Identifier: Apache-2.0
"""ServingExecutor: what it hands a tensor-parallel executor for the batch digest."""

from __future__ import annotations

import torch

from epd_encoder.api.metrics import Metrics
from epd_encoder.preprocess.base import StagedImage
from epd_encoder.server.executor import PartSource, PixelSource, ServingExecutor
from epd_encoder.types import ItemOutput, PreprocessedImage


class RecordingTP:
    """The TP executors' signature: ``encode(items, *, keys, costs)``."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def encode(self, items, *, keys=None, costs=None):
        self.calls.append({"grids": [it.grid_thw for it in items], "keys": keys, "costs": costs})
        return [ItemOutput(torch.zeros(it.num_tokens, 4)) for it in items]


def finish(staged: StagedImage, device=None) -> PreprocessedImage:
    return PreprocessedImage(staged.pixels.float().reshape(staged.pixels.shape[0], -1), staged.grid_thw,
                             staged.num_tokens)


def source(key: bytes, grid, cost: int) -> PixelSource:
    t, h, w = grid
    staged = StagedImage(torch.zeros(t * h * w, 3, 2, 2, dtype=torch.uint8), grid, t * h * w // 4)
    return PixelSource(staged, lambda: staged, cost, finish, key=key)


def test_the_digest_names_each_item_by_content_key_and_first_temporal_group():
    tp = RecordingTP()
    serving = ServingExecutor(tp, preprocessor=None, metrics=Metrics(), max_batch_cost=1000)
    image, video = source(b"\x01" * 32, (1, 4, 4), 16), source(b"\x02" * 32, (6, 2, 2), 24)
    out = serving.encode([image, PartSource(video, 2, 4, 8), PartSource(video, 4, 6, 8)])
    assert all(isinstance(o, ItemOutput) for o in out)
    (call,) = tp.calls
    assert call["keys"] == [("01" * 32, 0), ("02" * 32, 2), ("02" * 32, 4)]
    assert call["costs"] == [16, 8, 8] and call["grids"] == [(1, 4, 4), (2, 2, 2), (2, 2, 2)]
