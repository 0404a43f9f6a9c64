# SPDX-License-Identifier: Apache-2.0
"""Images/s of epd-encoder preprocessing against the transformers processor of the same backend.

Our torchvision backend runs against transformers' torchvision processors, our PIL
backend against the PIL ones. All run in this process on the same encoded images,
with decode included (bytes -> pixel_values) and excluded (PIL RGB image ->
pixel_values). torchvision comes from the test-only side directory (see
tests/preprocess/tv_reference.py); without it only the PIL rows are measured.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from epd_encoder.preprocess.base import DecodeLimits
from epd_encoder.preprocess.decode import decode_image
from epd_encoder.preprocess.registry import load_preprocessor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.preprocess import tv_reference  # noqa: E402  (test-only: never imported by the package)
from timing import add_timing_flags, timing_clock  # noqa: E402

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


CLOCK = time.perf_counter


def rates(ref, ours, items, repeats: int) -> tuple[float, float]:
    """Best-of-``repeats`` images/s of both, passes interleaved so load drift hits both alike."""
    best = [float("inf"), float("inf")]
    for fn in (ref, ours):
        fn(items[0])  # warm-up
    for _ in range(repeats):
        for k, fn in enumerate((ref, ours)):
            t0 = CLOCK()
            for it in items:
                fn(it)
            best[k] = min(best[k], CLOCK() - t0)
    return len(items) / best[0], len(items) / best[1]


def bench(name: str, hf_proc, config: dict, model_type: str, blobs: list[bytes], repeats: int, backend: str) -> None:
    from transformers.image_utils import load_image

    pp = load_preprocessor(config, model_type, backend=backend)
    limits = DecodeLimits()
    decoded = [decode_image(b, limits) for b in blobs]

    def hf_bytes(b):
        return hf_proc(images=load_image(Image.open(io.BytesIO(b))), return_tensors="pt")

    def hf_image(im):
        return hf_proc(images=im, return_tensors="pt")

    rows = [
        ("decode included", *rates(hf_bytes, lambda b: pp.preprocess(decode_image(b, limits)), blobs, repeats)),
        ("decode incl., uint8 stage", *rates(hf_bytes, lambda b: pp.stage(decode_image(b, limits)), blobs, repeats)),
        ("decode excluded", *rates(hf_image, pp.preprocess, decoded, repeats)),
        ("excluded, uint8 stage only", *rates(hf_image, pp.stage, decoded, repeats)),
    ]
    for label, ref, ours in rows:
        print(f"{name:9s} {backend:11s} {label:27s} transformers {ref:7.1f} img/s   epd-encoder {ours:7.1f} img/s"
              f"   ratio {ours / ref:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="6 images, 1 repeat")
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    add_timing_flags(ap, "torch intra-op threads for both sides (0: torch's default)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = timing_clock(ap, args)
    n, repeats = (6, 1) if args.quick else (args.images, args.repeats)
    blobs = make_images(n)
    warnings.simplefilter("ignore")
    missing = tv_reference.missing_reason()
    if missing is None:
        tv_reference.enable()  # before transformers is imported: it decides its backends once
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    print(f"{n} JPEG images, sizes {SIZES}, best of {repeats}, {torch.get_num_threads()} torch threads, "
          f"{args.clock} clock")
    families = [("qwen2-vl", QWEN2, "qwen2_vl", "qwen2_vl", Qwen2VLImageProcessorPil),
                ("qwen3-vl", QWEN3, "qwen3_vl", "qwen2_vl", Qwen2VLImageProcessorPil),
                ("internvl", INTERNVL, "internvl", "got_ocr2", GotOcr2ImageProcessorPil)]
    for name, config, model_type, kind, pil_cls in families:
        if missing is None:
            bench(name, tv_reference.processor(kind, config), config, model_type, blobs, repeats, "torchvision")
        bench(name, pil_cls.from_dict(config), config, model_type, blobs, repeats, "pil")
    if missing is not None:
        print(f"torchvision rows skipped: {missing}")


if __name__ == "__main__":
    main()
