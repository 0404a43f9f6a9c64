# SPDX-License-Identifier: Apache-2.0
"""A mixed image + video load through a real server, against the naive server.

The model is a Qwen2.5-VL-style checkpoint with the 6-layer, 256-wide tower of
bench_tower.py (random weights, fp32, tiny LM). Both servers run in a subprocess, one
after the other, and get the same requests from ``--concurrency`` closed-loop HTTP
clients in this process; every item is unique (no cache hits). Ours: ``epd-encoder
serve``. The baseline: ``benchmarks/naive_server.py``, transformers' torchvision
image and video processors and vision module per request, no batching, no cache.

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


def start(cmd: list[str], url: str, log: Path | None = None) -> subprocess.Popen:
    """The server, up once /health answers 200; with ``log``, its output is kept there for
    the error when it does not start."""
    with (log.open("wb") if log is not None else open(os.devnull, "wb")) as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            proc.wait(30)
            tail = f":\n{log.read_text()[-3000:]}" if log is not None else ""
            raise RuntimeError(f"{' '.join(cmd[1:4])} did not start{tail}")
        time.sleep(0.2)


def load(name: str, cmd: list[str], url: str, requests, seconds: float, concurrency: int) -> dict:
    """Start the server, warm it with one item of each kind, run the closed loop, stop it."""
    proc = start(cmd, url)
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            for kind, data in [("image", make_image(10**6)), ("video", make_video(10**6))]:
                item = {"type": kind, kind: base64.b64encode(data).decode()}
                c.post("/v1/encode", json={"items": [item], "video_options": {"fps": 2}}).raise_for_status()
        done: list[tuple[str, float]] = []
        lock, it = threading.Lock(), iter(requests)
        stop_at = time.monotonic() + seconds

        def client() -> None:
            with httpx.Client(base_url=url, timeout=120) as c:
                while time.monotonic() < stop_at:
                    with lock:
                        nxt = next(it, None)
                    if nxt is None:
                        return
                    kind, data = nxt
                    item = {"type": kind, kind: base64.b64encode(data).decode()}
                    t0 = time.perf_counter()
                    r = c.post("/v1/encode", json={"items": [item], "video_options": {"fps": 2}})
                    if r.status_code != 200:
                        raise RuntimeError(f"{name}: {r.status_code}: {r.text[:200]}")
                    with lock:
                        done.append((kind, time.perf_counter() - t0))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return summary(name, done, time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    seconds = 4.0 if args.quick else args.seconds
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model")
        # More requests than either side finishes: the run is bounded by time, not by the list.
        requests = workload(60 if args.quick else int(seconds * 30))
        print(f"model: Qwen2.5-VL-style, tower {TOWER['depth']}x{TOWER['hidden_size']}, fp32, "
              f"{os.cpu_count()} CPUs; {args.concurrency} clients; {seconds:g} s per side")
        py, port = sys.executable, free_port()
        naive = load("naive", [py, str(Path(__file__).with_name("naive_server.py")), str(model_dir), str(port)],
                     f"http://127.0.0.1:{port}", requests, seconds, args.concurrency)
        port = free_port()
        ours = load("ours", [py, "-m", "epd_encoder.cli", "serve", "--model", str(model_dir), "--port", str(port)],
                    f"http://127.0.0.1:{port}", requests, seconds, args.concurrency)
    for k in ("images_per_s", "video_s_per_s"):
        print(f"ratio ours/naive {k}: {ours[k] / naive[k]:.2f}x" if naive[k] else f"{k}: baseline did none")
    print(f"ratio naive/ours p99: {naive['p99_ms'] / ours['p99_ms']:.2f}x (above 1: ours is lower)")


if __name__ == "__main__":
    main()
