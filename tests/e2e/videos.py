# SPDX-License-Identifier: Apache-2.0
"""Test videos, encoded here with PyAV: seeded noise over a moving gradient, so every
frame differs and a wrong frame index or resize shows in the embeddings."""

from __future__ import annotations

import io

import av
import numpy as np


def video(n: int = 12, size=(96, 64), rate: float = 10, seed: int = 0, codec: str = "libx264",
          fmt: str = "mp4", pix_fmt: str = "yuv420p", options: dict[str, str] | None = None) -> bytes:
    """``n`` frames of ``size`` (width, height) at ``rate`` fps; ``options`` go to the encoder
    (``{"bf": "0"}``: no B-frames, so an MP4 has no composition offsets or edit list)."""
    from fractions import Fraction

    w, h = size
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=Fraction(rate).limit_denominator(1001), options=options or {})
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        for i in range(n):
            base = (ramp + 9 * i) % 256 + rng.normal(0, 20, (h, w, 3))
            frame = av.VideoFrame.from_ndarray(np.clip(base, 0, 255).astype(np.uint8), format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def with_stts_delta(data: bytes, delta: int) -> bytes:
    """``data`` (a PyAV MP4: one time-to-sample entry) with that entry's frame duration set to ``delta``.
    Made without B-frames, every frame still decodes after the patch."""
    import struct

    at = data.index(b"stts")
    entries, = struct.unpack(">I", data[at + 8:at + 12])
    assert entries == 1, f"expected one stts entry, found {entries}"
    return data[:at + 16] + struct.pack(">I", delta) + data[at + 20:]
