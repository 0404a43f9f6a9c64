# SPDX-License-Identifier: Apache-2.0
"""Vision tower forward: our packed Qwen2.5-VL tower vs transformers' module, same weights.

CPU: a batch of 8 mixed images (112² to 448²) through a 6-layer, 256-wide
Qwen2.5-VL-style tower (random weights, fp32), runs interleaved, median of the
repeats. Target: >= 1.5x. Then the cost of --batch-invariant (every item alone)
against the default packed forward, same tower and images, fp32 and bf16.
Target: <= 1.3x the time, aim <= 1.15x. CUDA (when present): a Qwen2.5-VL-7B-sized
tower in bf16 on 1024² images, images/s and the fraction of the bf16 FLOP bound.
Run: python benchmarks/bench_tower.py [--quick] [--peak-tflops 989] [--no-cpu] [--threads N]
[--clock thread] (CPU time of the one working thread: steadier on a shared box; needs --threads 1)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2_5_VLConfig

from epd_encoder.models.towers import qwen2_5_vl
from epd_encoder.models.invariant import forward_units
from timing import add_timing_flags, timing_clock

CPU_SIZES = [(112, 112), (448, 448), (224, 336), (336, 224), (168, 448), (448, 280), (392, 392), (280, 168)]
CPU_TOWER = {
    "depth": 6, "hidden_size": 256, "num_heads": 4, "intermediate_size": 688, "out_hidden_size": 512,
    "window_size": 112, "fullatt_block_indexes": [2, 5], "patch_size": 14,
}
GPU_TOWER = {
    "depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420, "out_hidden_size": 3584,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "patch_size": 14,
}


def grid_for(h: int, w: int, factor: int = 28) -> tuple[int, int, int]:
    """The processor's grid for an image resized to multiples of patch*merge."""
    return (1, round(h / factor) * factor // 14, round(w / factor) * factor // 14)


def tower_flops(v: dict, grids: list[tuple[int, int, int]]) -> float:
    """Multiply-adds x2 of the linear layers, attention scores/values, patch embed and merger."""
    d, inter, m = v["hidden_size"], v["intermediate_size"], 4
    win = (v["window_size"] // v["patch_size"]) ** 2
    total = 0.0
    for t, h, w in grids:
        n = t * h * w
        total += 2 * n * 3 * 2 * 14 * 14 * d  # patch embed
        for i in range(v["depth"]):
            total += 2 * n * (4 * d * d + 3 * d * inter)
            seg = h * w if i in v["fullatt_block_indexes"] else min(win, h * w)
            total += 4 * n * seg * d
        total += 2 * (n // m) * (d * m * d * m + d * m * v["out_hidden_size"])
    return total


def build(v: dict, device: str, dtype: torch.dtype):
    cfg = Qwen2_5_VLConfig(vision_config=v)
    torch.manual_seed(0)
    with torch.device(device):
        ref = qwen2_5_vl.FAMILY.hf_reference(cfg).to(dtype).eval()
        ours = qwen2_5_vl.FAMILY.build_tower(cfg).to(dtype).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def inputs(grids, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3 * 2 * 14 * 14, generator=g).to(device), torch.tensor(grids)


CLOCK = time.perf_counter


def timed(fn, sync) -> float:
    sync()
    t0 = CLOCK()
    fn()
    sync()
    return CLOCK() - t0


def compare(ref, ours, pixels, grid, reps: int, sync) -> tuple[list[float], list[float], float]:
    """Seconds per batch (theirs, ours), interleaved run by run, and the max abs difference."""
    with torch.inference_mode():
        want = ref(pixels, grid_thw=grid.to(pixels.device)).pooler_output
        got, _ = ours.forward_packed(pixels, grid)
        diff = (got.float() - want.float()).abs().max().item()
        theirs, mine = [], []
        for _ in range(reps):
            theirs.append(timed(lambda: ref(pixels, grid_thw=grid.to(pixels.device)), sync))
            mine.append(timed(lambda: ours.forward_packed(pixels, grid), sync))
    return theirs, mine, diff


def cpu_bench(reps: int) -> None:
    grids = [grid_for(h, w) for h, w in CPU_SIZES]
    ref, ours = build(CPU_TOWER, "cpu", torch.float32)
    pixels, grid = inputs(grids, "cpu")
    theirs, mine, diff = compare(ref, ours, pixels, grid, reps, lambda: None)
    print(f"CPU fp32, {torch.get_num_threads()} threads, {CLOCK.__name__}: 8 images 112²..448² "
          f"({pixels.shape[0]} patches), 6-layer 256-wide Qwen2.5-VL-style tower, {reps} interleaved runs")
    for stat in (statistics.median, min):
        a, b = stat(theirs), stat(mine)
        print(f"  {stat.__name__:<6}  transformers {a * 1e3:8.1f} ms/batch   epd-encoder {b * 1e3:8.1f} ms/batch"
              f"   ratio {a / b:.2f}x")
    print(f"  max|diff| {diff:.1e}; target: >= 1.5x")


def invariant_bench(reps: int) -> None:
    """--batch-invariant (each item alone) vs the packed forward, interleaved, same tower."""
    grids = [grid_for(h, w) for h, w in CPU_SIZES]
    for dtype in (torch.float32, torch.bfloat16):
        _, ours = build(CPU_TOWER, "cpu", dtype)
        pixels, grid = inputs(grids, "cpu")
        pixels = pixels.to(dtype)
        packed, alone = [], []
        with torch.inference_mode():
            forward_units(ours.forward_packed, pixels, grid)  # warm both paths
            ours.forward_packed(pixels, grid)
            for _ in range(reps):
                packed.append(timed(lambda: ours.forward_packed(pixels, grid), lambda: None))
                alone.append(timed(lambda: forward_units(ours.forward_packed, pixels, grid), lambda: None))
        print(f"CPU {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads: --batch-invariant "
              f"vs packed, same 8 images, {reps} interleaved runs")
        for stat in (statistics.median, min):
            a, b = stat(packed), stat(alone)
            print(f"  {stat.__name__:<6}  packed {a * 1e3:8.1f} ms/batch   batch-invariant {b * 1e3:8.1f} ms/batch"
                  f"   cost {b / a:.2f}x")
    print("  target: <= 1.3x (aim <= 1.15x)")


def gpu_bench(reps: int, batch: int, peak_tflops: float, *, device: str = "cuda", v: dict = GPU_TOWER,
              size: int = 1024, dtype: torch.dtype = torch.bfloat16) -> None:
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    grids = [grid_for(size, size)] * batch
    ref, ours = build(v, device, dtype)
    pixels, grid = inputs(grids, device)
    pixels = pixels.to(dtype)
    theirs, mine, diff = compare(ref, ours, pixels, grid, reps, sync)
    theirs, mine = statistics.median(theirs), statistics.median(mine)
    flops = tower_flops(v, grids)
    name = torch.cuda.get_device_name() if cuda else device
    print(f"{device} {dtype} on {name}: Qwen2.5-VL tower depth {v['depth']} hidden {v['hidden_size']}, "
          f"{batch} images {size}² (grid {grids[0][1]}x{grids[0][2]}), {flops / batch / 1e12:.2f} TFLOP/image, "
          f"median of {reps}")
    for label, sec in (("transformers", theirs), ("epd-encoder", mine)):
        tflops = flops / sec / 1e12
        print(f"  {label:<12} {sec * 1e3:8.1f} ms/batch  {batch / sec:7.2f} images/s  "
              f"{tflops:6.1f} TFLOP/s = {tflops / peak_tflops:.1%} of {peak_tflops:.0f} peak")
    print(f"  ratio {theirs / mine:.2f}x   max|diff| {diff:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200: 989)")
    ap.add_argument("--gpu-batch", type=int, default=8, help="1024² images per forward on CUDA")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU comparison")
    add_timing_flags(ap)
    args = ap.parse_args()
    global CLOCK
    CLOCK = timing_clock(ap, args)
    if not args.no_cpu:
        cpu_bench(3 if args.quick else 9)
        invariant_bench(3 if args.quick else 9)
    if torch.cuda.is_available():
        gpu_bench(3 if args.quick else 10, args.gpu_batch, args.peak_tflops)
    else:
        print("CUDA not available: GPU numbers skipped")


if __name__ == "__main__":
    main()
