# SPDX-License-Identifier: Apache-2.0
"""Fakes for orchestration tests: an executor and a recording deliverer."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Sequence

import torch

from epd_encoder.engine.worker import ItemResult, Outcome
from epd_encoder.types import ItemOutput


def key_of(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def output_for(payload: Any, rows: int = 2, hidden: int = 4) -> ItemOutput:
    seed = sum(str(payload).encode())
    return ItemOutput(torch.full((rows, hidden), float(seed)))


class FakeExecutor:
    """Encodes a payload to a tensor derived from it; can be told to fail."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self.encoded = Counter()
        self.fail_next = 0
        self.bad_payloads: set[Any] = set()
        self.lock = threading.Lock()

    def encode(self, payloads: Sequence[Any]):
        with self.lock:
            self.calls.append(list(payloads))
            if self.fail_next:
                self.fail_next -= 1
                raise RuntimeError("CUDA out of memory (fake)")
            outs = []
            for p in payloads:
                self.encoded[p] += 1
                outs.append(ValueError(f"bad payload {p}") if p in self.bad_payloads else output_for(p))
            return outs


class RecordingDeliverer:
    def __init__(self, release_immediately: bool = True) -> None:
        self.items: list[ItemResult] = []
        self.outcomes: dict[str, Outcome] = {}
        self.finish_calls = Counter()
        self.after_finish: list[ItemResult] = []
        self.release_immediately = release_immediately
        self.raise_for: set[str] = set()

    def deliver(self, result: ItemResult) -> None:
        if result.request_id in self.outcomes:
            self.after_finish.append(result)
        if result.request_id in self.raise_for:
            raise ConnectionResetError("receiver went away (fake)")
        self.items.append(result)
        if self.release_immediately:
            result.release()

    def finish(self, outcome: Outcome) -> None:
        self.finish_calls[outcome.request_id] += 1
        self.outcomes[outcome.request_id] = outcome

    def items_of(self, rid: str) -> list[ItemResult]:
        return sorted((r for r in self.items if r.request_id == rid), key=lambda r: r.item_index)
