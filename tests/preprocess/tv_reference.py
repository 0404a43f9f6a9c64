# SPDX-License-Identifier: Apache-2.0
"""transformers' torchvision-backend image processors, as a test-only reference.

torchvision cannot be installed beside this CPU torch: the matching wheel is a CUDA
build whose C extension fails to load. Its pure-Python transforms work once its fake
op registrations (for the missing C ops) are skipped. ``make install`` puts it in
``.venv/torchvision-ref``, never in site-packages: there transformers would take
torchvision as usable everywhere, and the PIL reference would no longer be the default.

``run_reference`` runs the processors in a child process (``python -m
tests.preprocess.tv_reference JOB_DIR``) so that the test process never imports it.
``enable`` imports it in the current process, for the child and for the benchmark.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
SIDE_DIR = ROOT / ".venv" / "torchvision-ref"
PROCESSORS = {
    "qwen2_vl": "transformers.models.qwen2_vl.image_processing_qwen2_vl:Qwen2VLImageProcessor",
    "got_ocr2": "transformers.models.got_ocr2.image_processing_got_ocr2:GotOcr2ImageProcessor",
    "kimi_k25": "transformers.models.kimi_k25.image_processing_kimi_k25:Kimi_K25ImageProcessor",
}


def missing_reason() -> str | None:
    """Why the reference cannot run here, or None."""
    if not (SIDE_DIR / "torchvision" / "__init__.py").is_file():
        return f"torchvision reference not installed in {SIDE_DIR} (make install puts it there; needs PyPI)"
    return None


def enable() -> None:
    """Import torchvision from the side directory, skipping its fake op registrations."""
    if "torchvision" in sys.modules:
        return
    if "transformers" in sys.modules:
        raise RuntimeError("enable() must run before transformers is imported (it caches what is installed)")
    import torch.library

    sys.path.insert(0, str(SIDE_DIR))
    original = torch.library.register_fake
    torch.library.register_fake = lambda *a, **k: (lambda fn=None, *x, **y: fn)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchvision  # noqa: F401
            from torchvision.transforms.v2 import functional  # noqa: F401
    finally:
        torch.library.register_fake = original


def processor(kind: str, config: dict, workdir: Path | None = None):
    """A torchvision-backed transformers processor (call after ``enable``).

    ``kind="auto"``: what ``AutoImageProcessor`` picks for a checkpoint directory
    holding ``config["preprocessor"]`` and ``config["model"]``, as a deployment loads it.
    """
    import importlib

    if kind == "auto":
        from transformers import AutoImageProcessor

        (workdir / "preprocessor_config.json").write_text(json.dumps(config["preprocessor"]))
        (workdir / "config.json").write_text(json.dumps(config["model"]))
        return AutoImageProcessor.from_pretrained(str(workdir))
    module, name = PROCESSORS[kind].split(":")
    return getattr(importlib.import_module(module), name).from_dict(config)


def _child(job_dir: Path) -> None:
    enable()
    from PIL import Image
    from transformers.image_utils import load_image

    spec = json.loads((job_dir / "jobs.json").read_text())
    blobs = {k: bytes(v.numpy()) for k, v in load_file(job_dir / "images.safetensors").items()}
    out: dict[str, torch.Tensor] = {}
    classes: dict[str, str] = {}
    for i, job in enumerate(spec["jobs"]):
        workdir = job_dir / f"ckpt{i}"
        workdir.mkdir()
        proc = processor(job["processor"], job["config"], workdir)
        classes[job["name"]] = type(proc).__name__
        for name in job["images"]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # What a transformers user feeds the processor (conftest.reference_image).
                res = proc(images=load_image(Image.open(io.BytesIO(blobs[name]))), return_tensors="pt")
            key = f"{job['name']}/{name}"
            out[f"{key}/pixel_values"] = res["pixel_values"].contiguous()
            grid = res["image_grid_thw"] if "image_grid_thw" in res else torch.tensor(res["num_patches"])
            out[f"{key}/grid"] = grid.contiguous()
    save_file(out, str(job_dir / "out.safetensors"))
    (job_dir / "classes.json").write_text(json.dumps(classes))


def run_reference(jobs: list[dict], images: dict[str, bytes], timeout: float = 900) -> tuple[dict, dict]:
    """Run jobs ``{name, processor, config, images}`` on the named ``images`` in a child.

    ``grid`` is ``image_grid_thw`` (Qwen) or ``num_patches`` (GotOcr2). Returns
    ``({job: {image: (pixel_values, grid)}}, {job: the processor's class name})``.
    """
    reason = missing_reason()
    if reason:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "jobs.json").write_text(json.dumps({"jobs": jobs}))
        save_file({k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in images.items()},
                  str(d / "images.safetensors"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "tests.preprocess.tv_reference", str(d)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"torchvision reference failed:\n{proc.stderr[-4000:]}")
        flat = load_file(d / "out.safetensors")
        classes = json.loads((d / "classes.json").read_text())
    results: dict[str, dict] = {}
    for job in jobs:
        results[job["name"]] = {
            name: (flat[f"{job['name']}/{name}/pixel_values"], flat[f"{job['name']}/{name}/grid"])
            for name in job["images"]
        }
    return results, classes


# Video: transformers' video processors (torchvision only), fed by its own PyAV loader.
VIDEO_PROCESSORS = {
    "qwen2_vl": "transformers.models.qwen2_vl.video_processing_qwen2_vl:Qwen2VLVideoProcessor",
    "qwen3_vl": "transformers.models.qwen3_vl.video_processing_qwen3_vl:Qwen3VLVideoProcessor",
}


def video_processor(kind: str, config: dict):
    """A transformers video processor whose ``fetch_videos`` decodes with its PyAV loader
    (call after ``enable``). Its default loader is torchcodec, which is not installed, and
    torchvision >= 0.26 no longer decodes; ``load_video(backend="pyav")`` is transformers'
    own reader, called exactly as ``fetch_videos`` calls its default one."""
    import importlib

    module, name = VIDEO_PROCESSORS[kind].split(":")
    return decode_with_pyav(getattr(importlib.import_module(module), name).from_dict(config))


def decode_with_pyav(proc):
    """``proc`` (a transformers video processor) with ``fetch_videos`` on transformers' PyAV reader."""
    from transformers.video_utils import load_video

    def fetch_pyav(urls, sample_indices_fn=None):
        if isinstance(urls, list):
            return list(zip(*[fetch_pyav(x, sample_indices_fn=sample_indices_fn) for x in urls]))
        return load_video(urls, backend="pyav", sample_indices_fn=sample_indices_fn)

    proc.fetch_videos = fetch_pyav
    return proc


def video_timing(proc, metadata) -> dict[str, torch.Tensor]:
    """Qwen2.5-VL's second_per_grid_ts and Qwen3-VL's per-patch timestamps, by the processors' code."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    tps = proc.temporal_patch_size
    # processing_qwen2_5_vl.Qwen2_5_VLProcessor._process_videos
    spg = tps / metadata.sampled_fps
    stamps = Qwen3VLProcessor._calculate_timestamps(None, metadata.frames_indices, metadata.fps, tps)
    return {"second_per_grid_ts": torch.tensor([spg], dtype=torch.float64),
            "timestamps": torch.tensor(stamps, dtype=torch.float64)}


def _child_video(job_dir: Path) -> None:
    enable()
    import numpy as np

    spec = json.loads((job_dir / "video_jobs.json").read_text())
    blobs = load_file(job_dir / "videos.safetensors")
    paths = {}
    for name, blob in blobs.items():
        paths[name] = job_dir / f"video_{len(paths)}.mp4"
        paths[name].write_bytes(bytes(blob.numpy()))
    out: dict[str, torch.Tensor] = {}
    for job in spec["jobs"]:
        proc = video_processor(job["processor"], job["config"])
        for name in job["videos"]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = proc(videos=str(paths[name]), do_sample_frames=True, return_metadata=True,
                           return_tensors="pt", **job.get("kwargs", {}))
            meta = res["video_metadata"][0]
            key = f"{job['name']}/{name}"
            out[f"{key}/pixel_values"] = res["pixel_values_videos"].contiguous()
            out[f"{key}/grid"] = res["video_grid_thw"].contiguous()
            out[f"{key}/indices"] = torch.as_tensor(np.asarray(meta.frames_indices), dtype=torch.int64)
            out[f"{key}/fps"] = torch.tensor([meta.fps], dtype=torch.float64)
            out[f"{key}/total"] = torch.tensor([meta.total_num_frames], dtype=torch.int64)
            out.update({f"{key}/{k}": v for k, v in video_timing(proc, meta).items()})
    save_file(out, str(job_dir / "out.safetensors"))


def run_video_reference(jobs: list[dict], videos: dict[str, bytes], timeout: float = 900) -> dict:
    """Run video jobs ``{name, processor, config, videos, kwargs?}`` in a child.

    Each video goes through the processor as a file path, so transformers' PyAV loader
    reads the header and decodes only what its ``sample_frames`` picked. Returns
    ``{job: {video: {pixel_values, grid, indices, fps, total, second_per_grid_ts, timestamps}}}``.
    """
    reason = missing_reason()
    if reason:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "video_jobs.json").write_text(json.dumps({"jobs": jobs}))
        save_file({k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in videos.items()},
                  str(d / "videos.safetensors"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "tests.preprocess.tv_reference", str(d)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"torchvision video reference failed:\n{proc.stderr[-4000:]}")
        flat = load_file(d / "out.safetensors")
    results: dict[str, dict] = {}
    for job in jobs:
        results[job["name"]] = {}
        for name in job["videos"]:
            prefix = f"{job['name']}/{name}/"
            results[job["name"]][name] = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    return results


if __name__ == "__main__":
    if (Path(sys.argv[1]) / "video_jobs.json").is_file():
        _child_video(Path(sys.argv[1]))
    else:
        _child(Path(sys.argv[1]))
