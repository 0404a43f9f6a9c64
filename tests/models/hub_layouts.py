# SPDX-License-Identifier: Apache-2.0
"""Checkpoints laid out as each family's real Hub repository is, written by transformers.

The model comes from ``write_tiny_model`` (transformers' ``save_pretrained``, config.json
included). The processors are saved by their own ``save_pretrained``: the image processor
to ``preprocessor_config.json``, the video processor to ``video_preprocessor_config.json``
and the processor to ``processor_config.json``, in a child process that imports the
test-only torchvision (tests/preprocess/tv_reference.py; the video processor classes need
it). Then every file the family's Hub repository does not carry is removed (``HUB_FILES``;
docs/models.md, "Files of a Hub checkpoint"). The same child loads each pruned directory
with ``AutoImageProcessor`` and ``AutoVideoProcessor``, as a deployment would, and keeps
their output on one image and their video settings for the tests to compare with.

``hub_checkpoint(family)`` builds every family once per process (one child, about 20 s).
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Files of the real repositories that a deployment may read, weights apart (docs/models.md).
_QWEN2 = ("config.json", "generation_config.json", "preprocessor_config.json", "chat_template.json",
          "tokenizer.json", "tokenizer_config.json")
_QWEN3 = (*_QWEN2, "video_preprocessor_config.json")
_QWEN3_5 = ("config.json", "generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
            "chat_template.jinja", "tokenizer.json", "tokenizer_config.json")
HUB_FILES: dict[str, tuple[str, ...]] = {
    "qwen2_vl": _QWEN2,  # Qwen/Qwen2-VL-7B-Instruct
    "qwen2_5_vl": _QWEN2,  # Qwen/Qwen2.5-VL-7B-Instruct
    "qwen3_vl": _QWEN3,  # Qwen/Qwen3-VL-8B-Instruct
    "qwen3_5": _QWEN3_5,  # Qwen/Qwen3.5-9B
    "qwen3_5_moe": _QWEN3_5,  # Qwen/Qwen3.5-35B-A3B
    # OpenGVLab/InternVL3-1B-hf: one model.safetensors; processor_config.json not nested
    "internvl": ("config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json",
                 "video_preprocessor_config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"),
    # moonshotai/Kimi-K2.5: tiktoken.model instead of tokenizer.json
    "kimi_k25": ("config.json", "generation_config.json", "preprocessor_config.json", "chat_template.jinja",
                 "tokenizer_config.json"),
}
# moonshotai/Kimi-K2.5's preprocessor_config.json keeps its settings under media_proc_cfg, for its
# remote code; transformers 5.24's Kimi_K25ImageProcessor ignores both keys (its class defaults).
KIMI_HUB_EXTRA = {
    "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
                 "AutoProcessor": "kimi_k25_processor.KimiK25Processor"},
    "media_proc_cfg": {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "patch_limit_on_one_side": 512},
}
SHARDS = {"internvl": 1}  # the others keep the vision tower in shards apart from the LM
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "internvl")
IMAGE_SIZE = (97, 61)  # odd sides: every family resizes it


def image_bytes() -> bytes:
    """The PNG every reference and every test encodes."""
    import numpy as np
    from PIL import Image

    w, h = IMAGE_SIZE
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x * y) % 256], axis=-1)
    pixels = np.clip(base + rng.integers(-30, 31, size=(h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _weights(src: Path, out: Path, family: str) -> None:
    """Copy the safetensors; Qwen3.5 names its shards ``model.safetensors-0000i-of-0000n``."""
    index = src / "model.safetensors.index.json"
    if not index.is_file():
        shutil.copyfile(src / "model.safetensors", out / "model.safetensors")
        return
    doc = json.loads(index.read_text())
    rename = {f: f.replace("model-", "model.safetensors-", 1) if family.startswith("qwen3_5") else f
              for f in set(doc["weight_map"].values())}
    for old, new in rename.items():
        shutil.copyfile(src / old, out / new)
    doc["weight_map"] = {k: rename[v] for k, v in doc["weight_map"].items()}
    (out / index.name).write_text(json.dumps(doc, indent=2))


def prune(out: Path, family: str) -> None:
    """Remove every file but the family's Hub files and the weights."""
    keep = set(HUB_FILES[family])
    for f in out.iterdir():
        if f.is_file() and f.name not in keep and not f.name.startswith("model"):
            f.unlink()


def _child(root: Path) -> None:
    """Save the processors, prune, then load each directory as transformers does."""
    sys.path.insert(0, str(ROOT))
    from tests.preprocess import tv_reference

    tv_reference.enable()
    import torch
    from PIL import Image
    from safetensors.torch import save_file
    from transformers import AutoImageProcessor, AutoProcessor, AutoVideoProcessor
    from transformers.image_utils import load_image

    image = load_image(Image.open(io.BytesIO((root / "image.png").read_bytes())))
    tensors: dict[str, torch.Tensor] = {}
    settings: dict[str, dict] = {}
    for family in HUB_FILES:
        src, out = root / "src" / family, root / family
        out.mkdir()
        proc = AutoProcessor.from_pretrained(src)
        proc.image_processor.save_pretrained(out)
        if getattr(proc, "video_processor", None) is not None:
            proc.video_processor.save_pretrained(out)
        proc.save_pretrained(out)
        # Hub repositories predate v5's nested processor_config.json: only the processor's own keys.
        nested = json.loads((out / "processor_config.json").read_text())
        legacy = {k: v for k, v in nested.items() if k not in ("image_processor", "video_processor")}
        (out / "processor_config.json").write_text(json.dumps(legacy, indent=2))
        if family == "kimi_k25":  # the Hub file also names Moonshot's remote code and its own settings
            pre = json.loads((out / "preprocessor_config.json").read_text())
            (out / "preprocessor_config.json").write_text(json.dumps({**KIMI_HUB_EXTRA, **pre}, indent=2))
        for name in ("config.json", "generation_config.json"):
            shutil.copyfile(src / name, out / name)
        _weights(src, out, family)
        prune(out, family)
        res = AutoImageProcessor.from_pretrained(out)(images=image, return_tensors="pt")
        tensors[f"{family}/pixel_values"] = res["pixel_values"].contiguous()
        grid = res["image_grid_thw"] if "image_grid_thw" in res else torch.tensor(res["num_patches"])
        tensors[f"{family}/grid"] = grid.reshape(-1).contiguous()
        if family in VIDEO_FAMILIES:
            video = AutoVideoProcessor.from_pretrained(out)
            settings[family] = {"class": type(video).__name__, **json.loads(video.to_json_string())}
    save_file(tensors, str(root / "reference.safetensors"))
    (root / "video.json").write_text(json.dumps(settings, indent=2))


@functools.cache
def _built() -> Path:
    from epd_encoder.models.tiny import write_tiny_model
    from tests.preprocess import tv_reference

    if reason := tv_reference.missing_reason():
        raise RuntimeError(reason)
    root = Path(tempfile.mkdtemp(prefix="epd-hub-layouts-"))
    atexit.register(shutil.rmtree, root, True)
    for family in HUB_FILES:
        write_tiny_model(family, root / "src" / family, num_shards=SHARDS.get(family, 3))
    (root / "image.png").write_bytes(image_bytes())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "tests.models.hub_layouts", str(root)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"writing the Hub layouts failed:\n{run.stderr[-4000:]}")
    return root


def hub_checkpoint(family: str) -> Path:
    """The family's checkpoint directory, as its Hub repository lays it out."""
    return _built() / family


def source_checkpoint(family: str) -> Path:
    """The ``write_tiny_model`` directory it was made from (every file, ``epd-encoder`` layout)."""
    return _built() / "src" / family


def reference(family: str) -> tuple:
    """``(pixel_values, grid, video settings or None)`` of transformers' Auto classes on it."""
    from safetensors.torch import load_file

    root = _built()
    flat = load_file(root / "reference.safetensors")
    video = json.loads((root / "video.json").read_text()).get(family)
    return flat[f"{family}/pixel_values"], flat[f"{family}/grid"], video


def missing_reason() -> str | None:
    from tests.preprocess import tv_reference

    return tv_reference.missing_reason()


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
