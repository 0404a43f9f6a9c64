# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the push-delivery tests: items, outputs and a release recorder."""

from __future__ import annotations

import threading

import torch

from epd_encoder.transfer.messages import WireItem
from epd_encoder.types import ItemOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_item(i: int = 0, tokens: int = 4, hidden: int = 8, dtype: str = "float32",
              n_ds: int = 0, seed: int = 0) -> tuple[WireItem, ItemOutput]:
    g = torch.Generator().manual_seed(seed * 1000 + i)
    rand = lambda: torch.randn(tokens, hidden, generator=g).to(DTYPES[dtype])
    out = ItemOutput(rand(), tuple(rand() for _ in range(n_ds)) if n_ds else None)
    item = WireItem(key=f"{seed:032x}{i:032x}", num_tokens=tokens, grid_thw=(1, 2, max(2 * tokens, 1)),
                    hidden_size=hidden, dtype=dtype, num_deepstack=n_ds)
    return item, out


def make_room(n: int = 1, **kw) -> tuple[list[WireItem], list[ItemOutput]]:
    pairs = [make_item(i, **kw) for i in range(n)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


class Release:
    """A ``release`` callback that counts its calls and can be awaited."""

    def __init__(self) -> None:
        self.calls = 0
        self._event = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self._event.set()

    def wait(self, timeout: float = 5.0) -> bool:
        return self._event.wait(timeout)


def assert_same(received, outputs, items) -> None:
    assert len(received) == len(outputs)
    for got, want, item in zip(received, outputs, items):
        assert got.key == item.key and got.num_tokens == item.num_tokens
        assert got.grid_thw == tuple(item.grid_thw)
        assert got.embedding.dtype == want.embedding.dtype
        assert torch.equal(got.embedding, want.embedding)
        if want.deepstack is None:
            assert got.deepstack is None
        else:
            assert len(got.deepstack) == len(want.deepstack)
            for a, b in zip(got.deepstack, want.deepstack):
                assert torch.equal(a, b)


def wait_for(pred, timeout: float = 5.0, step: float = 0.005) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()
