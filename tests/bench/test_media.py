# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from epd_encoder.bench.media import MediaSource, noise_clip, noise_image
from epd_encoder.bench.workload import Media, PlannedRequest


def test_images_are_a_pure_function_of_seed_namespace_and_index():
    a = noise_image(0, 1, 5, 64, 48)
    assert a == noise_image(0, 1, 5, 64, 48)
    assert len({a, noise_image(1, 1, 5, 64, 48), noise_image(0, 2, 5, 64, 48), noise_image(0, 1, 6, 64, 48)}) == 4
    img = Image.open(io.BytesIO(a))
    assert img.format == "PNG" and img.size == (64, 48)
    jpeg = Image.open(io.BytesIO(noise_image(0, 1, 5, 64, 48, "jpeg")))
    assert jpeg.format == "JPEG" and jpeg.size == (64, 48)


def test_source_renders_items_keeps_them_and_reports_ready():
    src = MediaSource(seed=7)
    req = PlannedRequest((Media("image", 1, 0, 32, 40), Media("image", 1, 0, 32, 40)))
    assert not src.ready(req)
    a, b = src.items(req)
    assert a == b and a["type"] == "image" and src.ready(req)
    assert Image.open(io.BytesIO(base64.b64decode(a["image"]))).size == (32, 40)
    assert MediaSource(seed=7).items(req) == [a, b]  # a fresh source renders the same bytes


def test_source_bounds_what_it_keeps():
    src = MediaSource(keep_bytes=1)
    first = PlannedRequest((Media("image", 1, 0, 16, 16),))
    src.items(first)
    src.items(PlannedRequest((Media("image", 1, 1, 16, 16),)))
    assert not src.ready(first)  # evicted; rendering it again gives the same bytes


def test_image_dir_cycles_sorted_files(tmp_path):
    for name in ("b.png", "a.png"):
        Image.new("RGB", (8, 8), (len(name), 0, 0)).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("skip me")
    src = MediaSource(image_dir=tmp_path)
    assert [p.name for p in src.files] == ["a.png", "b.png"]
    assert src.data(Media("image", 1, 2)) == (tmp_path / "a.png").read_bytes()
    with pytest.raises(ValueError, match="no image files"):
        MediaSource(image_dir=_empty(tmp_path))


def _empty(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_trace_refs_read_files_or_pass_urls(tmp_path):
    (tmp_path / "x.png").write_bytes(b"raw")
    src = MediaSource()
    assert src.item(Media("image", 0, -1, ref=str(tmp_path / "x.png"))) == {"type": "image",
                                                                             "image": base64.b64encode(b"raw").decode()}
    assert src.item(Media("video", 0, -1, ref="https://h/v.mp4")) == {"type": "video_url",
                                                                       "video_url": {"url": "https://h/v.mp4"}}


def test_clips_decode_with_the_planned_frames():
    import av

    data = noise_clip(0, 1, 3, seconds=1.0, size=(64, 48), fps=8)
    assert data == noise_clip(0, 1, 3, seconds=1.0, size=(64, 48), fps=8)
    with av.open(io.BytesIO(data)) as c:
        frames = list(c.decode(video=0))
    assert len(frames) == 8 and (frames[0].width, frames[0].height) == (64, 48)
