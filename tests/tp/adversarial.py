# SPDX-License-Identifier: Apache-2.0
"""Test-only rank hooks for tests/e2e/test_tp_adversarial.py (inert unless a test names them).

``make_rank`` and ``make_weights_rank`` are group handler factories
(``"tests.tp.adversarial:make_rank"``): the real ``DataRank`` or ``WeightsRank``, plus (1)
every digest this rank *agreed to* appended to a file, and (2) a forward that fails on this
rank only, for any item of the ``poison`` grid (a failed share in data mode; in weights mode
the rank leaves the group mid-collective, which is fatal by design). ``recording`` is the
same digest record for rank 0 (the test process), so both ranks' lists are written by one
function at one point: after ``agree`` returned, i.e. after the all-gather matched.
"""

from __future__ import annotations

from typing import Any

import epd_encoder.tp.rank as rank_process
from epd_encoder.tp.data import make_data_rank
from epd_encoder.tp.weights import make_weights_rank as real_weights_rank


def recording(path: str) -> Any:
    """``agree`` that appends ``"<seq> <digest hex>"`` once the ranks agreed."""
    real = rank_process.agree

    def agree(digest: bytes, seq: int) -> None:
        real(digest, seq)  # raises RankMismatch on a difference: nothing recorded then
        with open(path, "a") as f:
            f.write(f"{seq} {digest.hex()}\n")

    return agree


def make_rank(rank: int, size: int, record: str, poison: list[int], **spec: Any):
    handler = make_data_rank(rank, size, **spec)
    rank_process.agree = recording(record)  # rank_process.serve looks ``agree`` up at call time
    real = handler.executor.encode

    def encode(items, **kw):
        # Inside DataRank.run's try: reported to rank 0 as this share's failure, as a real
        # forward error would be; rank 0's own replica never fails.
        if any(list(it.grid_thw) == poison for it in items):
            raise RuntimeError(f"injected fault on rank {rank} only")
        return real(items, **kw)

    handler.executor.encode = encode
    return handler


def make_weights_rank(rank: int, size: int, record: str, poison: list[int], **spec: Any):
    handler = real_weights_rank(rank, size, **spec)
    rank_process.agree = recording(record)
    real = handler._forward

    def forward(pixels, grid):
        if any(row == poison for row in grid.tolist()):
            raise RuntimeError(f"injected fault on rank {rank} only")
        return real(pixels, grid)

    handler._forward = forward
    return handler
