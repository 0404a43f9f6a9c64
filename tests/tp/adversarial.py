# SPDX-License-Identifier: Apache-2.0
"""Test-only rank hooks for tests/e2e/test_tp_adversarial.py (inert unless a test names them).

``make_rank`` and ``make_weights_rank`` are group handler factories
(``"tests.tp.adversarial:make_rank"``): the real ``DataRank`` or ``WeightsRank``, plus (1)
every digest this rank *agreed to* appended to a file, and (2) a forward that fails on this
rank only, for any item of the ``poison`` grid (a failed share in data mode; in weights mode
the rank leaves the group mid-collective, which is fatal by design). ``recording`` is the
same digest record for rank 0 (the test process), so both ranks' lists are written by one
function at one point: before the all-gather compares them, so each list is what that rank
formed, and two lists differ when the ranks formed different batches. ``make_late_liar``
is a rank that forms another batch from a given batch on (the check's own test).
"""

from __future__ import annotations

from typing import Any

import epd_encoder.tp.rank as rank_process
from epd_encoder.tp.data import make_data_rank
from epd_encoder.tp.weights import make_weights_rank as real_weights_rank


def recording(path: str) -> Any:
    """``agree`` that appends ``"<seq> <digest hex>"``, then lets the ranks compare."""
    real = rank_process.agree

    def agree(digest: bytes, seq: int) -> None:
        with open(path, "a") as f:  # before the comparison: a rank that differs is on record
            f.write(f"{seq} {digest.hex()}\n")
        real(digest, seq)

    return agree


class LateLiar:
    """Forms rank 0's batches up to ``from_seq``, another one from then on; runs nothing."""

    def __init__(self, from_seq: int) -> None:
        self.from_seq = from_seq

    def digest(self, work: Any) -> bytes:
        return work.digest() if work.seq < self.from_seq else bytes(32)

    def run(self, work: Any) -> None:
        pass


def make_late_liar(rank: int, size: int, record: str, from_seq: int) -> LateLiar:
    rank_process.agree = recording(record)
    return LateLiar(from_seq)


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
