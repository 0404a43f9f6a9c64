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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    seconds = 0.3 if args.quick else 2.0
    cases = [  # (name, tokens, hidden, dtype, deepstack)
        ("64MB fp32", 16384, 1024, torch.float32, 0),
        ("64MB bf16 +3 deepstack", 4096, 2048, torch.bfloat16, 3),
        ("1MB fp32 x 16 items", 256, 1024, torch.float32, 0),
    ]
    print(f"{'body':<26}{'MB':>7}{'raw GB/s':>10}{'pack GB/s':>11}{'unpack GB/s':>13}"
          f"{'st.save GB/s':>14}{'pack/raw':>10}{'unpack/raw':>12}")
    for name, tokens, hidden, dtype, n_ds in cases:
        n_items = 16 if "x 16" in name else 1
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
        gbs = lambda s: nbytes / s / 1e9  # noqa: E731
        print(f"{name:<26}{nbytes / 1e6:>7.1f}{gbs(raw):>10.2f}{gbs(pack):>11.2f}{gbs(unpack):>13.2f}"
              f"{gbs(st):>14.2f}{pack / raw:>9.2f}x{unpack / raw:>11.2f}x")
    print("ratios are time vs the raw copy (lower is better; 1.0x = one copy)")


if __name__ == "__main__":
    main()
