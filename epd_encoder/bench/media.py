# SPDX-License-Identifier: Apache-2.0
"""Rendering planned media into request items (``{"type": "image", "image": <base64>}``).

Generated content is a pure function of ``(seed, namespace, index)``: random noise (so
no two indices compress alike or share a content key), an image of the planned size as
PNG or JPEG, or a short H.264 clip (PyAV) of noise over a moving gradient. With an image
folder, index ``i`` is the ``i``-th file (sorted, cycling). Trace references are read
from disk, or sent as ``image_url`` / ``video_url`` items for the server to fetch.

Rendered items are kept (LRU, bounded in bytes) so a baseline run after ours reuses them.
"""

from __future__ import annotations

import base64
import io
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from epd_encoder.bench.workload import Media, PlannedRequest

ImageFormat = Literal["png", "jpeg"]
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})


class ItemSource(Protocol):
    """What the load loop needs: the JSON items of a request, and whether that is cheap now."""

    def items(self, request: PlannedRequest) -> list[dict]: ...

    def ready(self, request: PlannedRequest) -> bool: ...


def noise_image(seed: int, namespace: int, index: int, width: int, height: int,
                fmt: ImageFormat = "png") -> bytes:
    from PIL import Image

    rng = np.random.default_rng([seed, namespace, index, 1])
    buf = io.BytesIO()
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG" if fmt == "png" else "JPEG", quality=90)
    return buf.getvalue()


def noise_clip(seed: int, namespace: int, index: int, *, seconds: float = 2.0, size=(160, 120),
               fps: int = 10) -> bytes:
    """An H.264 MP4: every frame differs, so sampling and resizing show in the embeddings."""
    import av

    w, h = size
    rng = np.random.default_rng([seed, namespace, index, 2])
    ramp = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps, options={"preset": "veryfast"})
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(max(1, round(seconds * fps))):
            frame = (ramp + 9 * i + index) % 256 + rng.normal(0, 16, (h, w, 3))
            vf = av.VideoFrame.from_ndarray(np.clip(frame, 0, 255).astype(np.uint8), format="rgb24")
            for p in s.encode(vf):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


class MediaSource:
    """Renders and keeps items; thread-safe (the loop renders off its event loop)."""

    def __init__(self, seed: int = 0, *, image_format: ImageFormat = "png", image_dir: str | Path | None = None,
                 video_seconds: float = 2.0, video_size: tuple[int, int] = (160, 120), video_fps: int = 10,
                 keep_bytes: int = 1 << 30) -> None:
        self.seed, self.image_format = seed, image_format
        self.video_seconds, self.video_size, self.video_fps = video_seconds, video_size, video_fps
        self.files: list[Path] = []
        if image_dir is not None:
            self.files = sorted(p for p in Path(image_dir).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not self.files:
                raise ValueError(f"--image-dir {image_dir}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
        self._keep, self._held = keep_bytes, 0
        self._cache: OrderedDict[Media, dict] = OrderedDict()
        self._lock = threading.Lock()

    def ready(self, request: PlannedRequest) -> bool:
        with self._lock:
            return all(m in self._cache for m in request.items)

    def items(self, request: PlannedRequest) -> list[dict]:
        return [self.item(m) for m in request.items]

    def item(self, media: Media) -> dict:
        with self._lock:
            hit = self._cache.get(media)
            if hit is not None:
                self._cache.move_to_end(media)
                return hit
        item = self._render(media)
        size = len(item.get(media.kind, ""))
        with self._lock:
            self._cache[media] = item
            self._held += size
            while self._held > self._keep and len(self._cache) > 1:
                old, dropped = self._cache.popitem(last=False)
                self._held -= len(dropped.get(old.kind, ""))
        return item

    def data(self, media: Media) -> bytes:
        """The raw bytes of generated or local media (not of a URL reference)."""
        if media.ref is not None:
            return Path(media.ref).read_bytes()
        if media.kind == "video":
            return noise_clip(self.seed, media.namespace, media.index, seconds=self.video_seconds,
                              size=self.video_size, fps=self.video_fps)
        if self.files:
            return self.files[media.index % len(self.files)].read_bytes()
        return noise_image(self.seed, media.namespace, media.index, media.width, media.height, self.image_format)

    def _render(self, media: Media) -> dict:
        if media.ref is not None and media.ref.startswith(("http://", "https://")):
            kind = f"{media.kind}_url"
            return {"type": kind, kind: {"url": media.ref}}
        return {"type": media.kind, media.kind: base64.b64encode(self.data(media)).decode()}
