# SPDX-License-Identifier: Apache-2.0
"""Weights-mode tensor-parallel encode: every rank holds 1/N of the tower and runs every batch.

Skeleton (interface final; the body follows): see ``TPWeightsExecutor``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from epd_encoder.errors import RankFailed
from epd_encoder.tp.data import ExecutorSpec
from epd_encoder.tp.group import DEFAULT_HEARTBEAT_S, DEFAULT_TIMEOUT_S
from epd_encoder.types import ItemOutput, PreprocessedImage


class TPWeightsExecutor:
    """``VisionExecutor``'s interface over a weights-mode rank group (same constructor as ``TPExecutor``)."""

    mode = "weights"

    def __init__(self, spec: ExecutorSpec, size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 on_failure: Callable[[RankFailed], None] | None = None) -> None:
        raise NotImplementedError("weights mode: in progress")

    def start(self) -> "TPWeightsExecutor":
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "TPWeightsExecutor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def expected_tokens(self, items: Sequence[PreprocessedImage]) -> list[int]:
        raise NotImplementedError

    def warmup(self, item: PreprocessedImage | None = None) -> None:
        raise NotImplementedError

    def encode(self, items: Sequence[PreprocessedImage], *, keys: Sequence[tuple[str, int]] | None = None,
               costs: Sequence[int] | None = None) -> list[ItemOutput]:
        raise NotImplementedError
