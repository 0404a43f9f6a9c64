# SPDX-License-Identifier: Apache-2.0
"""Wire-format throughput: pack/unpack of an inline body vs a raw tensor copy.

Baseline: ``tensor.numpy().tobytes()`` (one memcpy of the embedding). Also shown:
``safetensors.torch.save`` on the same tensors. Target: pack and unpack within
~1.3x of the raw copy time (one copy each). Run: python benchmarks/bench_wire.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from safetensors.torch import save as st_save

from epd_encoder.types import ItemOutput
from epd_encoder.wire import ItemMeta, pack_inline, unpack_inline


def seconds_per_call(fn, seconds: float) -> float:
    fn()  # warm
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def run_case(name: str, n_items: int, tokens: int, hidden: int, dtype: torch.dtype, n_ds: int,
             *, seconds: float) -> str:
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(n_items):
        emb = torch.randn(tokens, hidden, generator=g).to(dtype)
        ds = tuple(torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(n_ds))
        out = ItemOutput(emb, ds or None)
        meta = ItemMeta.describe(out, key=f"{i:064x}", grid_thw=(1, 2, tokens * 2), cache="miss")
        items.append((meta, out))
    tensors = [t for _, o in items for t in (o.embedding, *(o.deepstack or ()))]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    named = {f"t{i}": t for i, t in enumerate(tensors)}

    raw = seconds_per_call(lambda: [t.view(torch.uint8).numpy().tobytes() for t in tensors], seconds)
    pack = seconds_per_call(lambda: pack_inline(items, model="bench", request_id="r"), seconds)
    body = pack_inline(items, model="bench", request_id="r")
    unpack = seconds_per_call(lambda: unpack_inline(body), seconds)
    st = seconds_per_call(lambda: st_save(named, {"format": "x"}), seconds)
    gb = nbytes / 1e9
    return (f"{name:<26}{nbytes / 1e6:>7.1f}{gb / raw:>10.2f}{gb / pack:>11.2f}{gb / unpack:>13.2f}"
            f"{gb / st:>14.2f}{pack / raw:>9.2f}x{unpack / raw:>11.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    seconds = 0.3 if args.quick else 2.0
    cases = [  # (name, items, tokens, hidden, dtype, deepstack tensors)
        ("64MB fp32", 1, 16384, 1024, torch.float32, 0),
        ("64MB bf16 +3 deepstack", 1, 4096, 2048, torch.bfloat16, 3),
        ("1MB fp32 x 16 items", 16, 256, 1024, torch.float32, 0),
    ]
    print(f"{'body':<26}{'MB':>7}{'raw GB/s':>10}{'pack GB/s':>11}{'unpack GB/s':>13}"
          f"{'st.save GB/s':>14}{'pack/raw':>10}{'unpack/raw':>12}")
    for case in cases:
        print(run_case(*case, seconds=seconds))
    print("ratios are time vs the raw copy (lower is better; 1.0x = one copy)")


if __name__ == "__main__":
    main()
