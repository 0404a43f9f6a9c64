# SPDX-License-Identifier: Apache-2.0
"""Images/s of epd-encoder preprocessing against the transformers PIL processor.

Both run in this process on the same encoded images, with decode included
(bytes -> pixel_values) and excluded (PIL RGB image -> pixel_values).
"""

from __future__ import annotations

import argparse
import io
import time
import warnings

import numpy as np
from PIL import Image
from transformers.image_utils import load_image
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from epd_encoder.preprocess.base import DecodeLimits, load_preprocessor
from epd_encoder.preprocess.decode import decode_image

QWEN2 = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
         "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
QWEN3 = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
INTERNVL = {"crop_to_patches": True, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225],
            "max_patches": 12, "min_patches": 1, "resample": 3, "size": {"height": 448, "width": 448}}
SIZES = [(640, 480), (1024, 768), (1280, 720), (1500, 900), (800, 1200), (333, 517)]


def make_images(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        y, x = np.mgrid[0:h, 0:w]
        arr = np.stack([x * 255 // w, y * 255 // h, (x ^ y) & 255], -1) + rng.integers(-30, 31, (h, w, 3))
        buf = io.BytesIO()
        Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def rate(fn, items, repeats: int) -> float:
    fn(items[0])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for it in items:
            fn(it)
        best = min(best, time.perf_counter() - t0)
    return len(items) / best


def bench(name: str, hf_proc, config: dict, model_type: str, blobs: list[bytes], repeats: int) -> None:
    pp = load_preprocessor(config, model_type)
    limits = DecodeLimits()
    decoded = [decode_image(b, limits) for b in blobs]

    def hf_bytes(b):
        return hf_proc(images=load_image(Image.open(io.BytesIO(b))), return_tensors="pt")

    def hf_image(im):
        return hf_proc(images=im, return_tensors="pt")

    rows = [
        ("decode included", rate(hf_bytes, blobs, repeats), rate(lambda b: pp.preprocess(decode_image(b, limits)), blobs, repeats)),
        ("decode excluded", rate(hf_image, decoded, repeats), rate(pp.preprocess, decoded, repeats)),
        ("excluded, uint8 stage only", rate(hf_image, decoded, repeats), rate(pp.stage, decoded, repeats)),
    ]
    for label, ref, ours in rows:
        print(f"{name:9s} {label:27s} transformers {ref:7.1f} img/s   epd-encoder {ours:7.1f} img/s   ratio {ours / ref:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="6 images, 1 repeat")
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n, repeats = (6, 1) if args.quick else (args.images, args.repeats)
    blobs = make_images(n)
    warnings.simplefilter("ignore")
    print(f"{n} JPEG images, sizes {SIZES}, best of {repeats}")
    bench("qwen2-vl", Qwen2VLImageProcessorPil.from_dict(QWEN2), QWEN2, "qwen2_vl", blobs, repeats)
    bench("qwen3-vl", Qwen2VLImageProcessorPil.from_dict(QWEN3), QWEN3, "qwen3_vl", blobs, repeats)
    bench("internvl", GotOcr2ImageProcessorPil.from_dict(INTERNVL), INTERNVL, "internvl", blobs, repeats)


if __name__ == "__main__":
    main()
