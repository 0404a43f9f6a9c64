# SPDX-License-Identifier: Apache-2.0
"""Content-key hashing throughput: blake3 keys vs sha256 and vs a plain memcpy.

Inputs: a 1080p JPEG (what a hit path hashes) and a raw 1080p RGB buffer.
Target: >= 5 GB/s on the raw buffer. Run: python benchmarks/bench_hashing.py [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import time

import numpy as np
from PIL import Image

from epd_encoder.preprocess.keys import KeyContext


def throughput(fn, data: bytes, seconds: float) -> float:
    fn(data)  # warm
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn(data)
        n += 1
    return n * len(data) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    seconds = 0.3 if args.quick else 2.0
    rng = np.random.default_rng(0)
    # A smooth gradient plus noise compresses like a photo, not like white noise.
    y, x = np.mgrid[0:1080, 0:1920]
    rgb = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)
    rgb = np.clip(rgb + rng.integers(0, 24, rgb.shape), 0, 255).astype(np.uint8)
    raw = rgb.tobytes()
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90)
    jpeg = buf.getvalue()

    ctx = KeyContext(model_id="bench", revision="0", params={"max_pixels": 1 << 20})
    print(f"{'input':<22}{'size MB':>9}{'blake3 key GB/s':>17}{'sha256 GB/s':>13}"
          f"{'memcpy GB/s':>13}{'vs sha256':>11}{'vs memcpy':>11}")
    for name, data in (("1080p JPEG q90", jpeg), ("1080p raw RGB", raw)):
        key = throughput(ctx.key, data, seconds)
        sha = throughput(lambda d: hashlib.sha256(d).digest(), data, seconds)
        cpy = throughput(lambda d: bytearray(d), data, seconds)
        print(f"{name:<22}{len(data) / 1e6:>9.2f}{key / 1e9:>17.2f}{sha / 1e9:>13.2f}"
              f"{cpy / 1e9:>13.2f}{key / sha:>10.1f}x{key / cpy:>10.2f}x")
    print("target: blake3 key >= 5 GB/s on the raw buffer")


if __name__ == "__main__":
    main()
