# SPDX-License-Identifier: Apache-2.0
"""Vision tower forward on video: our packed towers vs transformers' modules, same weights.

CPU: one clip of 16 frames at 448² (8 temporal patches; 8192 patches at
patch 14, 6272 at patch 16) through the 6-layer, 256-wide towers of
bench_tower.py (random weights, fp32): Qwen2.5-VL-style (windows + full
attention) and Qwen3-VL-style (deepstack, interpolated position embedding).
Runs interleaved, median of the repeats; also the same clip encoded as 4
chunks of whole temporal groups (what the server does with a long video) vs
whole. CUDA (when present): the Qwen2.5-VL-7B-sized tower in bf16 on the same
clip shape. Target: >= 1.5x, as for images.
Run: python benchmarks/bench_tower_video.py [--quick] [--frames 16] [--size 448] [--no-cpu]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_tower import CPU_TOWER, GPU_TOWER, timed
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

from epd_encoder.models.towers import qwen2_5_vl, qwen3_vl

QWEN3_TOWER = {
    "depth": 6, "hidden_size": 256, "num_heads": 4, "intermediate_size": 688, "out_hidden_size": 512,
    "patch_size": 16, "num_position_embeddings": 2304, "deepstack_visual_indexes": [1, 3],
}
FAMILIES = {
    "qwen2_5_vl": (qwen2_5_vl.FAMILY, Qwen2_5_VLConfig, CPU_TOWER),
    "qwen3_vl": (qwen3_vl.FAMILY, Qwen3VLConfig, QWEN3_TOWER),
}


def build(family: str, v: dict, device: str, dtype: torch.dtype):
    fam, config_cls, _ = FAMILIES[family]
    cfg = config_cls(vision_config=v)
    torch.manual_seed(0)
    with torch.device(device):
        ref = fam.hf_reference(cfg).to(dtype).eval()
        ours = fam.build_tower(cfg).to(dtype).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def clip(v: dict, frames: int, size: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic ``pixel_values_videos`` of one clip and its ``video_grid_thw``, seeded."""
    p, tp = v["patch_size"], 2
    side = size // (2 * p) * 2  # the processor's grid: a multiple of the merge size
    grid = (frames // tp, side, side)
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(grid[0] * side * side, 3 * tp * p * p, generator=g)
    return pixels.to(device=device, dtype=dtype), torch.tensor([grid])


def chunked(ours, pixels: torch.Tensor, grid: torch.Tensor, parts: int) -> torch.Tensor:
    """The clip as ``parts`` chunks of whole temporal groups, one forward each."""
    t, h, w = grid[0].tolist()
    bounds = [t * i // parts for i in range(parts + 1)]
    return torch.cat([
        ours.forward_packed(pixels[a * h * w:b * h * w], torch.tensor([[b - a, h, w]]))[0]
        for a, b in zip(bounds, bounds[1:]) if b > a
    ])


def bench(family: str, v: dict, frames: int, size: int, reps: int, device: str, dtype: torch.dtype) -> None:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ref, ours = build(family, v, device, dtype)
    pixels, grid = clip(v, frames, size, device, dtype)
    gd = grid.to(device)
    with torch.inference_mode():
        want = ref(pixels, grid_thw=gd).pooler_output
        got, _ = ours.forward_packed(pixels, grid)
        diff = (got.float() - want.float()).abs().max().item()
        cdiff = (chunked(ours, pixels, grid, 4).float() - got.float()).abs().max().item()
        theirs, mine, parts = [], [], []
        for _ in range(reps):
            theirs.append(timed(lambda: ref(pixels, grid_thw=gd), sync))
            mine.append(timed(lambda: ours.forward_packed(pixels, grid), sync))
            parts.append(timed(lambda: chunked(ours, pixels, grid, 4), sync))
    where = f"{device} {str(dtype).removeprefix('torch.')}"
    if device == "cpu":
        where += f", {torch.get_num_threads()} threads"
    t, h, w = grid[0].tolist()
    print(f"{where}: {family} tower depth {v['depth']} hidden {v['hidden_size']}, {frames} frames {size}² "
          f"(grid {t}x{h}x{w}, {pixels.shape[0]} patches), {reps} interleaved runs")
    for stat in (statistics.median, min):
        a, b, c = stat(theirs), stat(mine), stat(parts)
        print(f"  {stat.__name__:<6}  transformers {a * 1e3:8.1f} ms   epd-encoder {b * 1e3:8.1f} ms   "
              f"ratio {a / b:.2f}x   as 4 chunks {c * 1e3:8.1f} ms ({c / b:.2f}x whole)")
    print(f"  max|diff| vs transformers {diff:.1e}, chunks vs whole {cdiff:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--frames", type=int, default=16, help="sampled frames (2 per temporal patch)")
    ap.add_argument("--size", type=int, default=448, help="frame side in pixels")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU comparison")
    args = ap.parse_args()
    reps = 3 if args.quick else 7
    if not args.no_cpu:
        for family, (_, _, v) in FAMILIES.items():
            bench(family, v, args.frames, args.size, reps, "cpu", torch.float32)
        print("  target: >= 1.5x")
    if torch.cuda.is_available():
        bench("qwen2_5_vl", GPU_TOWER, args.frames, args.size, reps, "cuda", torch.bfloat16)
    else:
        print("CUDA not available: GPU numbers skipped")


if __name__ == "__main__":
    main()
