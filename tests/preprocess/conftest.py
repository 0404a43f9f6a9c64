# SPDX-License-Identifier: Apache-2.0
"""A varied set of encoded test images and the transformers reference to compare with."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from PIL import Image

QWEN2_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
QWEN3_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
}
INTERNVL_CONFIG = {
    "crop_to_patches": True,
    "data_format": "channels_first",
    "default_to_square": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
    "max_patches": 12,
    "min_patches": 1,
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 448, "width": 448},
    "image_processor_type": "GotOcr2ImageProcessorFast",
    "processor_class": "InternVLProcessor",
}


def rgb_array(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus noise: structure for the resampler, entropy for the codecs."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(-40, 41, size=(h, w, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def exif_with_orientation(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def _palette_image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(rgb_array(w, h, seed)).quantize(colors=32)


def build_corpus() -> dict[str, bytes]:
    c: dict[str, bytes] = {}
    for w, h in [(28, 28), (1, 1), (13, 7), (517, 333), (1500, 900), (2000, 12), (10, 1900), (57, 901)]:
        c[f"png_rgb_{w}x{h}"] = encode(Image.fromarray(rgb_array(w, h, w + h)), "PNG")
    c["jpeg_rgb_640x480"] = encode(Image.fromarray(rgb_array(640, 480, 1)), "JPEG", quality=90)
    for o in range(1, 9):
        c[f"jpeg_exif_{o}"] = encode(Image.fromarray(rgb_array(61, 37, o)), "JPEG", exif=exif_with_orientation(o))
    c["png_exif_6"] = encode(Image.fromarray(rgb_array(45, 29, 9)), "PNG", exif=exif_with_orientation(6))
    c["jpeg_cmyk"] = encode(Image.fromarray(rgb_array(90, 70, 2)).convert("CMYK"), "JPEG")
    c["jpeg_gray"] = encode(Image.fromarray(rgb_array(90, 70, 3)).convert("L"), "JPEG")
    rgba = rgb_array(120, 80, 4)
    alpha = np.tile(np.linspace(0, 255, 120, dtype=np.uint8), (80, 1))
    c["png_rgba"] = encode(Image.fromarray(np.dstack([rgba, alpha])), "PNG")
    c["png_la"] = encode(Image.fromarray(np.dstack([rgba[..., 0], alpha])), "PNG")
    pal = _palette_image(77, 51, 5)
    c["png_p"] = encode(pal, "PNG")
    c["png_p_transparent"] = encode(pal, "PNG", transparency=3)
    c["png_l_trns"] = encode(Image.fromarray(rgba[..., 1]), "PNG", transparency=int(rgba[0, 0, 1]))
    c["png_rgb_trns"] = encode(Image.fromarray(rgba), "PNG", transparency=tuple(int(v) for v in rgba[0, 0]))
    c["png_i16"] = encode(Image.fromarray((rgb_array(64, 48, 6)[..., 0].astype(np.uint16) * 3)), "PNG")
    c["png_1bit"] = encode(Image.fromarray(rgb_array(40, 30, 7)).convert("1"), "PNG")
    c["gif"] = encode(_palette_image(66, 44, 8), "GIF", transparency=0)
    frames = [_palette_image(50, 30, s) for s in (10, 11)]
    c["gif_animated"] = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    c["webp_lossy"] = encode(Image.fromarray(rgb_array(300, 200, 12)), "WEBP", quality=80)
    c["webp_rgba"] = encode(Image.fromarray(np.dstack([rgba, alpha])), "WEBP", lossless=True)
    c["bmp_rgb"] = encode(Image.fromarray(rgb_array(99, 41, 13)), "BMP")
    c["bmp_p"] = encode(_palette_image(35, 25, 14), "BMP")
    return c


CORPUS = build_corpus()


def reference_image(data: bytes) -> Image.Image:
    """What a transformers user feeds the processor: ``load_image`` of the opened bytes."""
    from transformers.image_utils import load_image

    return load_image(Image.open(io.BytesIO(data)))


def reference_output(processor, image: Image.Image) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return processor(images=image, return_tensors="np")


@pytest.fixture(scope="session")
def corpus() -> dict[str, bytes]:
    return CORPUS
