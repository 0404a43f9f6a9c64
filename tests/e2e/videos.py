# SPDX-License-Identifier: Apache-2.0
"""Test videos, encoded here with PyAV: seeded noise over a moving gradient, so every
frame differs and a wrong frame index or resize shows in the embeddings."""

from __future__ import annotations

import io

import av
import numpy as np


def video(n: int = 12, size=(96, 64), rate: float = 10, seed: int = 0, codec: str = "libx264",
          fmt: str = "mp4", pix_fmt: str = "yuv420p") -> bytes:
    """``n`` frames of ``size`` (width, height) at ``rate`` fps."""
    from fractions import Fraction

    w, h = size
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=Fraction(rate).limit_denominator(1001))
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        for i in range(n):
            base = (ramp + 9 * i) % 256 + rng.normal(0, 20, (h, w, 3))
            frame = av.VideoFrame.from_ndarray(np.clip(base, 0, 255).astype(np.uint8), format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()
