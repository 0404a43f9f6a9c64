# SPDX-License-Identifier: Apache-2.0
"""Video preprocessing of epd-encoder against transformers' torchvision video processor.

Decode + sample + resize + patchify (+ normalize) of one clip, both sides in this
process: ours is probe -> plan -> stream_video(planned indices) -> stage -> finish
from the bytes in memory; transformers' is its processor called on the file path,
reading it with its own PyAV loader and ``sample_frames`` (tests/preprocess/tv_reference
``video_processor``; torchvision from the test-only side directory). The clips are
H.264 made here with PyAV: 10 s of 720p30 and 60 s of 480p30 (--quick: 1 s and 4 s).
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
import warnings
from pathlib import Path

import av
import numpy as np
import torch

from epd_encoder.preprocess.registry import load_video_preprocessor
from epd_encoder.preprocess.video_decode import VideoLimits, decode_video, probe_video, stream_video

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.preprocess import tv_reference  # noqa: E402  (test-only: never imported by the package)

QWEN2_5 = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
           "fps": 2.0}
QWEN3 = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 2, "min_frames": 4,
         "max_frames": 768}
LIMITS = VideoLimits()


def make_clip(w: int, h: int, seconds: float, rate: int = 30) -> bytes:
    """Moving gradients with mild noise, H.264 yuv420p (x264 veryfast, keyframe every 2 s)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:h, 0:w]
    noise = [rng.integers(-8, 9, (h, w, 3)) for _ in range(4)]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=rate, options={"preset": "veryfast", "g": str(2 * rate)})
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(int(seconds * rate)):
            base = np.stack([(x // 3 + i * 2) % 256, (y // 2 + i) % 256, ((x + y) // 4 + i * 3) % 256], -1)
            frame = np.clip(base + noise[i % 4], 0, 255).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def ours_fn(pp, stage_only: bool):
    params = pp.params()

    def run(data: bytes):
        plan = pp.plan(probe_video(data, LIMITS), params)
        staged = pp.stage(stream_video(data, LIMITS, plan.indices), plan)  # the served path
        return staged if stage_only else pp.finish(staged)
    return run


def best_times(runs: list[tuple], repeats: int) -> list[float]:
    """Best-of-``repeats`` seconds of each ``(fn, arg)``, passes interleaved so load drift hits all alike."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for k, (fn, arg) in enumerate(runs):
            t0 = time.perf_counter()
            fn(arg)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 s and 4 s clips, 1 repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads for both sides (0: default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    seconds, repeats = ((1, 4), 1) if args.quick else ((10, 60), args.repeats)
    warnings.simplefilter("ignore")
    missing = tv_reference.missing_reason()
    if missing is None:
        tv_reference.enable()  # before transformers is imported: it decides its backends once
    clips = {"720p": make_clip(1280, 720, seconds[0]), "480p": make_clip(854, 480, seconds[1])}
    print(f"best of {repeats}, {torch.get_num_threads()} torch threads; clips: "
          + ", ".join(f"{k} {probe_video(v, LIMITS).frames} frames ({len(v) / 1e6:.1f} MB)" for k, v in clips.items()))
    with tempfile.TemporaryDirectory() as tmp:
        for fam, model_type, kind, config in [("qwen2.5-vl", "qwen2_5_vl", "qwen2_vl", QWEN2_5),
                                              ("qwen3-vl", "qwen3_vl", "qwen3_vl", QWEN3)]:
            pp = load_video_preprocessor(config, model_type)
            hf = tv_reference.video_processor(kind, {**config, "cap_pixels_per_frame": False}) if not missing else None
            for clip, data in clips.items():
                path = Path(tmp) / f"{clip}.mp4"
                path.write_bytes(data)
                header = probe_video(data, LIMITS)
                plan = pp.plan(header, pp.params())
                decoded = decode_video(data, LIMITS, plan.indices)
                print(f"{fam} {clip}: {header.frames} frames -> {plan.sampled} sampled, grid {plan.grid_thw}")
                # frames/s: source frames with decoding (all are decoded up to the last sampled), else sampled ones
                cases = [("decode included", header.frames, data, path),
                         ("decode excluded", plan.sampled, decoded, decoded.frames[: plan.sampled])]
                for label, frames, ours_in, ref_in in cases:
                    included = ours_in is data
                    runs = [(ours_fn(pp, False) if included else (lambda v: pp.finish(pp.stage(v, plan))), ours_in),
                            (ours_fn(pp, True) if included else (lambda v: pp.stage(v, plan)), ours_in)]
                    if hf is not None:
                        runs.append((lambda x: hf(videos=str(x) if isinstance(x, Path) else x,
                                                  do_sample_frames=isinstance(x, Path), return_tensors="pt"), ref_in))
                    ours, stage, *ref = best_times(runs, repeats)
                    line = (f"  {label:15s} epd-encoder {ours:6.3f} s ({frames / ours:5.0f} frames/s, "
                            f"uint8 stage {stage:6.3f} s)")
                    if ref:
                        line += (f"   transformers {ref[0]:6.3f} s ({frames / ref[0]:5.0f} frames/s)"
                                 f"   ratio {ref[0] / ours:4.2f}x")
                    print(line)
    if missing is not None:
        print(f"transformers rows skipped: {missing}")


if __name__ == "__main__":
    main()
