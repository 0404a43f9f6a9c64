# SPDX-License-Identifier: Apache-2.0
"""A mixed image + video load through a real server, against a naive per-request loop.

The model is a Qwen2.5-VL-style checkpoint with the 6-layer, 256-wide tower of
bench_tower.py (random weights, fp32, tiny LM). Ours: ``epd-encoder serve`` in a
subprocess, ``--concurrency`` closed-loop clients over HTTP, every item unique (no
cache hits). The baseline, side by side on the same requests: what a team would
write without an encode tier, one request at a time in this process: transformers'
torchvision image and video processors (the test-only reference, from the side
directory) and transformers' vision module, no batching, no cache, no HTTP. The
baseline's latency is its service time; under the same concurrency a closed loop
would queue behind it, so its p99 is printed as measured, not comparable.

Requests: 70% one image (112² to 448²), 30% one clip (3 s, 320x240 at 15 fps,
sampled at 2 fps). Prints images/s, video-seconds/s, p50/p99 latency and ratios.
Run: python benchmarks/bench_video_serve.py [--quick] [--seconds 30] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.preprocess import tv_reference  # noqa: E402  (test-only: never imported by the package)

TOWER = {"depth": 6, "hidden_size": 256, "num_heads": 4, "intermediate_size": 688,
         "window_size": 112, "fullatt_block_indexes": [2, 5], "patch_size": 14}
CLIP_SECONDS, CLIP_SIZE, CLIP_RATE = 3.0, (320, 240), 15
VIDEO_SHARE = 0.3


def write_model(out: Path) -> Path:
    """The tiny Qwen2.5-VL checkpoint with the benchmark tower in place of the tiny one."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from epd_encoder.models.tiny import write_tiny_model

    d = write_tiny_model("qwen2_5_vl", out)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vision_config"].update(TOWER)
    (d / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)
    for f in d.glob("*.safetensors*"):
        f.unlink()
    model.save_pretrained(d)
    return d


def make_video(seed: int) -> bytes:
    import av

    w, h = CLIP_SIZE
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=CLIP_RATE, options={"preset": "veryfast"})
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(int(CLIP_SECONDS * CLIP_RATE)):
            base = (ramp + 7 * i + seed) % 256 + rng.normal(0, 12, (h, w, 3))
            for p in s.encode(av.VideoFrame.from_ndarray(np.clip(base, 0, 255).astype(np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def make_image(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    w, h = (int(rng.integers(4, 17)) * 28 for _ in range(2))
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def workload(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    rnd = random.Random(seed)
    return [("video", make_video(i)) if rnd.random() < VIDEO_SHARE else ("image", make_image(i)) for i in range(n)]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary(name: str, done: list[tuple[str, float]], wall: float) -> dict:
    lat = [t for _, t in done]
    images = sum(1 for k, _ in done if k == "image")
    videos = sum(1 for k, _ in done if k == "video")
    out = {"images_per_s": images / wall, "video_s_per_s": videos * CLIP_SECONDS / wall,
           "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "requests": len(done)}
    print(f"{name:>8}: {out['images_per_s']:6.2f} images/s  {out['video_s_per_s']:6.2f} video-s/s  "
          f"p50 {out['p50_ms']:7.1f} ms  p99 {out['p99_ms']:7.1f} ms  ({len(done)} requests, {wall:.1f} s)")
    return out


def run_ours(model_dir: Path, requests, seconds: float, concurrency: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "epd_encoder.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--preprocess-workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=120) as c:  # the same warm-up as the baseline's
            for kind, data in [("image", make_image(10**6)), ("video", make_video(10**6))]:
                item = {"type": kind, kind: base64.b64encode(data).decode()}
                c.post("/v1/encode", json={"items": [item], "video_options": {"fps": 2}}).raise_for_status()
        done: list[tuple[str, float]] = []
        lock, it = threading.Lock(), iter(enumerate(requests))
        stop_at = time.monotonic() + seconds

        def client() -> None:
            with httpx.Client(base_url=url, timeout=120) as c:
                while time.monotonic() < stop_at:
                    with lock:
                        nxt = next(it, None)
                    if nxt is None:
                        return
                    _, (kind, data) = nxt
                    item = {"type": kind, kind: base64.b64encode(data).decode()}
                    t0 = time.perf_counter()
                    r = c.post("/v1/encode", json={"items": [item], "video_options": {"fps": 2}})
                    if r.status_code != 200:
                        raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
                    with lock:
                        done.append((kind, time.perf_counter() - t0))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return summary("ours", done, time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(30)


def run_naive(model_dir: Path, requests, seconds: float) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = json.loads((model_dir / "preprocessor_config.json").read_text())
    image_proc = tv_reference.processor("qwen2_vl", cfg)
    video_cfg = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    video_proc = tv_reference.video_processor("qwen2_vl", {**video_cfg, "fps": 2})
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    visual = model.model.visual
    done: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        warm = [("image", make_image(10**6)), ("video", make_video(10**6))]
        stop_at, t_start = float("inf"), 0.0
        for i, (kind, data) in enumerate(warm + list(requests)):
            if i == len(warm):  # both kinds ran once (lazy init, first kernels): time from here
                stop_at, t_start = time.monotonic() + seconds, time.perf_counter()
            if time.monotonic() >= stop_at:
                break
            t0 = time.perf_counter()
            if kind == "image":
                res = image_proc(images=Image.open(io.BytesIO(data)).convert("RGB"), return_tensors="pt")
                visual(res["pixel_values"], grid_thw=res["image_grid_thw"])
            else:
                path = Path(tmp) / f"{i}.mp4"
                path.write_bytes(data)
                res = video_proc(videos=str(path), do_sample_frames=True, return_tensors="pt")
                visual(res["pixel_values_videos"], grid_thw=res["video_grid_thw"])
            if i >= len(warm):
                done.append((kind, time.perf_counter() - t0))
    return summary("naive", done, time.perf_counter() - t_start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few seconds per side")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    reason = tv_reference.missing_reason()
    if reason:
        print(f"skipped: {reason}")
        return
    tv_reference.enable()  # before transformers is imported: the baseline is the torchvision backend
    seconds = 4.0 if args.quick else args.seconds
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model")
        requests = workload(40 if args.quick else 400)
        print(f"model: Qwen2.5-VL-style, tower {TOWER['depth']}x{TOWER['hidden_size']}, fp32, "
              f"{os.cpu_count()} CPUs; {args.concurrency} clients; {seconds:g} s per side")
        naive = run_naive(model_dir, requests, seconds)
        ours = run_ours(model_dir, requests, seconds, args.concurrency)
    for k in ("images_per_s", "video_s_per_s"):
        print(f"ratio ours/naive {k}: {ours[k] / naive[k]:.2f}x" if naive[k] else f"{k}: baseline did none")


if __name__ == "__main__":
    main()
