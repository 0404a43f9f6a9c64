# SPDX-License-Identifier: Apache-2.0
"""The naive baseline: what a team writes without an encode tier.

A FastAPI server with one route, ``POST /v1/encode``, that takes our request body
(``image`` / ``video`` items as base64, ``video_options.fps``) and for each item runs
transformers' processor (the torchvision backend, as deployments have it) and
transformers' vision module, per request: no batching across requests, no cache, no
admission control. FastAPI runs the sync route on its thread pool, so concurrent
requests run their forwards side by side. It answers the embeddings as raw float32
bytes. Benchmark-only: it needs the test-only torchvision side directory.

    python benchmarks/naive_server.py MODEL_DIR PORT
"""

from __future__ import annotations

import base64
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.preprocess import tv_reference  # noqa: E402  (test-only: never imported by the package)


def build_app(model_dir: Path):
    tv_reference.enable()  # before transformers: its processors then take the torchvision backend
    import torch
    from fastapi import FastAPI
    from fastapi.responses import Response
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoVideoProcessor

    # transformers' own lookup of the processor files: an absent one (Qwen2.5-VL ships no
    # video_preprocessor_config.json) falls back as it does for any transformers user.
    image_proc = AutoImageProcessor.from_pretrained(model_dir)
    video_proc = tv_reference.decode_with_pyav(AutoVideoProcessor.from_pretrained(model_dir))
    default_fps = getattr(video_proc, "fps", None) or 2.0
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    visual = model.model.visual
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/encode")
    def encode(body: dict):
        fps = (body.get("video_options") or {}).get("fps", default_fps)
        out = []
        with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
            for i, item in enumerate(body["items"]):
                data = base64.b64decode(item[item["type"]])
                if item["type"] == "image":
                    res = image_proc(images=Image.open(io.BytesIO(data)).convert("RGB"), return_tensors="pt")
                    emb = visual(res["pixel_values"], grid_thw=res["image_grid_thw"])
                else:
                    path = Path(tmp) / f"{i}.mp4"
                    path.write_bytes(data)
                    res = video_proc(videos=str(path), do_sample_frames=True, fps=fps, return_tensors="pt")
                    emb = visual(res["pixel_values_videos"], grid_thw=res["video_grid_thw"])
                emb = getattr(emb, "pooler_output", emb)
                out.append(emb.contiguous().numpy().tobytes())
        return Response(b"".join(out), media_type="application/octet-stream")

    return app


def main() -> None:
    import uvicorn

    model_dir, port = Path(sys.argv[1]), int(sys.argv[2])
    uvicorn.run(build_app(model_dir), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
