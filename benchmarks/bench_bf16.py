# SPDX-License-Identifier: Apache-2.0
"""bf16 against fp32 on the CPU: speed and error, our packed tower and transformers'.

Same random weights in both dtypes; fp32 and bf16 runs interleaved, best and median of
the repeats. Error of each bf16 output against the same implementation's fp32 output:
max abs, relative (Frobenius) and the worst per-token cosine. Towers: the SMALL
6-layer 256-wide Qwen2.5-VL-style tower on bench_tower.py's 8 mixed images, a 12-layer
768-wide one on two 448² images, and (``--large``) the Qwen2.5-VL-7B-sized tower on one
448² image (ours only: the reference doubles the 2.5 GB of fp32 weights).
bf16 matmuls run on AMX or AVX512-BF16 where /proc/cpuinfo lists them, and are emulated
(slow) elsewhere. Run: python benchmarks/bench_bf16.py [--quick] [--large] [--threads N]
[--clock thread] (CPU time of the one working thread: steadier on a shared box; needs --threads 1)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_tower import CPU_SIZES, CPU_TOWER, GPU_TOWER, build, grid_for, inputs
from timing import add_timing_flags, timing_clock

MID_TOWER = {
    "depth": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 2048, "out_hidden_size": 1024,
    "window_size": 112, "fullatt_block_indexes": [3, 7, 11], "patch_size": 14,
}

CLOCK = time.perf_counter


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    g, w = got.float(), want.float()
    rel = ((g - w).norm() / w.norm()).item()
    return (g - w).abs().max().item(), rel, F.cosine_similarity(g, w, dim=-1).min().item()


def run(name: str, v: dict, sizes: list[tuple[int, int]], reps: int, with_reference: bool) -> None:
    grids = [grid_for(h, w) for h, w in sizes]
    pixels, grid = inputs(grids, "cpu")
    ref32, ours32 = build(v, "cpu", torch.float32)
    impls = {"epd-encoder": (ours32, lambda m, p: m.forward_packed(p, grid)[0])}
    if with_reference:
        impls["transformers"] = (ref32, lambda m, p: m(p, grid_thw=grid).pooler_output)
    else:
        del ref32
    print(f"{name}: depth {v['depth']} hidden {v['hidden_size']}, {len(sizes)} images ({pixels.shape[0]} patches), "
          f"{torch.get_num_threads()} threads, {CLOCK.__name__}, {reps} interleaved runs")
    for label, (m32, fwd) in impls.items():
        m16 = type(m32)._from_config(m32.config) if label == "transformers" else None
        if m16 is None:
            _, m16 = build(v, "cpu", torch.bfloat16)  # same seed: the same weights, rounded
        else:
            m16.load_state_dict(m32.state_dict())
        m16 = m16.to(torch.bfloat16).eval()
        p16 = pixels.to(torch.bfloat16)
        times: dict[str, list[float]] = {"fp32": [], "bf16": []}
        with torch.inference_mode():
            want, got = fwd(m32, pixels), fwd(m16, p16)
            for _ in range(reps):
                for key, mod, p in (("fp32", m32, pixels), ("bf16", m16, p16)):
                    t0 = CLOCK()
                    fwd(mod, p)
                    times[key].append(CLOCK() - t0)
        mx, rel, cos = errors(got, want)
        a, b = times["fp32"], times["bf16"]
        print(f"  {label:<12} fp32 {min(a) * 1e3:8.1f} ms (median {statistics.median(a) * 1e3:8.1f})   "
              f"bf16 {min(b) * 1e3:8.1f} ms (median {statistics.median(b) * 1e3:8.1f})   "
              f"speed-up {min(a) / min(b):.2f}x (median {statistics.median(a) / statistics.median(b):.2f}x)")
        print(f"  {'':<12} bf16 vs fp32: max|diff| {mx:.2e}  relative {rel:.2e}  worst token cosine {cos:.6f}")
        del m16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--large", action="store_true", help="also the Qwen2.5-VL-7B-sized tower (ours only)")
    add_timing_flags(ap)
    args = ap.parse_args()
    global CLOCK
    CLOCK = timing_clock(ap, args)
    flags = cpu_flags()
    print(f"CPU flags: amx_bf16={'amx_bf16' in flags} avx512_bf16={'avx512_bf16' in flags} "
          f"(torch capability {torch.backends.cpu.get_cpu_capability()})")
    reps = 3 if args.quick else 7
    run("SMALL", CPU_TOWER, CPU_SIZES, reps, True)
    run("MID", MID_TOWER, [(448, 448), (448, 448)], max(2, reps // 2), True)
    if args.large:
        run("Qwen2.5-VL-7B-sized", GPU_TOWER, [(448, 448)], 2, False)


if __name__ == "__main__":
    main()
