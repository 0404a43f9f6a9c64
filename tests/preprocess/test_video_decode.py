# SPDX-License-Identifier: Apache-2.0
"""Video decoding under limits; every video is encoded here with PyAV itself."""

from __future__ import annotations

import dataclasses
import io

import av
import numpy as np
import pytest

from epd_encoder import errors as E
from epd_encoder.preprocess import video_decode as vd
from epd_encoder.preprocess.video_decode import VideoLimits, decode_video, probe_video
from tests.e2e.videos import video, with_stts_delta

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255),
           (128, 128, 128), (255, 255, 255)]
TOLERANCE = 12  # solid colours survive yuv420p and a lossy codec within a few levels


def encode(codec: str = "mpeg4", fmt: str = "mp4", size=(64, 48), n: int = 8, rate: int = 10,
           pts: list[int] | None = None, pix_fmt: str = "yuv420p") -> bytes:
    """``n`` solid-colour frames (COLOURS[i % 8]); ``pts`` overrides the timestamps."""
    w, h = size
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        for i in range(n):
            f = av.VideoFrame.from_ndarray(
                np.full((h, w, 3), COLOURS[i % len(COLOURS)], np.uint8), format="rgb24")
            if pts is not None:
                f.pts = pts[i]
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def assert_colours(frames: np.ndarray, indices) -> None:
    for row, i in zip(frames, indices):
        mean = row.reshape(-1, 3).astype(np.float64).mean(axis=0)
        assert np.abs(mean - COLOURS[i % len(COLOURS)]).max() < TOLERANCE, (i, mean)


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return encode()


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails the test if any frame is decoded: ``_frames`` is the only way to the decoder."""
    def refuse(*_a, **_k):
        raise AssertionError("a frame was decoded")
    monkeypatch.setattr(vd, "_frames", refuse)


# probe ------------------------------------------------------------------------
def test_probe_reads_the_header_without_decoding(mp4, no_decoding):
    h = probe_video(mp4, VideoLimits())
    assert (h.container, h.codec, h.width, h.height, h.frames) == ("mp4", "mpeg4", 64, 48, 8)
    assert h.fps == pytest.approx(10.0)
    assert h.duration_s == pytest.approx(0.8, abs=0.11)


def test_probe_webm_estimates_frames_it_does_not_declare():
    h = probe_video(encode("libvpx", "webm", n=5), VideoLimits())
    assert (h.container, h.codec, h.frames) == ("matroska", "vp8", 0)
    assert h.estimated_frames == 5


# decode -----------------------------------------------------------------------
@pytest.mark.parametrize("codec,fmt", [("mpeg4", "mp4"), ("libvpx", "webm"), ("libx264", "mp4"),
                                       ("mpeg4", "avi")])
def test_decode_all_frames_keeps_their_colours(codec, fmt):
    if codec not in av.codecs_available:
        pytest.skip(f"the bundled FFmpeg has no {codec} encoder")
    out = decode_video(encode(codec, fmt), VideoLimits())
    assert out.frames.shape == (8, 48, 64, 3) and out.frames.dtype == np.uint8
    assert out.indices == tuple(range(8)) and out.fps == pytest.approx(10.0)
    assert_colours(out.frames, out.indices)


def test_decode_selected_indices_in_the_order_asked(mp4):
    out = decode_video(mp4, VideoLimits(), indices=[5, 1, 1, 3])
    assert out.indices == (5, 1, 1, 3) and out.frames.shape == (4, 48, 64, 3)
    assert_colours(out.frames, out.indices)


def test_decode_stops_after_the_last_index_and_converts_only_those(mp4, monkeypatch):
    seen, converted = [], []
    real = vd._frames

    class Spy:
        def __init__(self, frame):
            self.frame, self.width, self.height, self.time = frame, frame.width, frame.height, frame.time

        def to_ndarray(self, **kw):
            converted.append(len(seen) - 1)
            return self.frame.to_ndarray(**kw)

    def spying(container, stream):
        for frame in real(container, stream):
            seen.append(frame)
            yield Spy(frame)

    monkeypatch.setattr(vd, "_frames", spying)
    out = decode_video(mp4, VideoLimits(), indices=[2, 4])
    assert len(seen) == 5 and converted == [2, 4]
    assert_colours(out.frames, out.indices)


def test_a_sampler_gets_the_header(mp4):
    out = decode_video(mp4, VideoLimits(), indices=lambda h: range(0, h.frames, 4))
    assert out.indices == (0, 4)
    assert_colours(out.frames, out.indices)


def test_bad_indices_are_invalid_input(mp4):
    with pytest.raises(E.InvalidInput):
        decode_video(mp4, VideoLimits(), indices=[-1])
    with pytest.raises(E.InvalidInput):
        decode_video(mp4, VideoLimits(), indices=[])


def test_an_index_past_the_end_is_undecodable(mp4):
    with pytest.raises(E.UndecodableVideo, match="ended after 8 frames"):
        decode_video(mp4, VideoLimits(), indices=[8])


# limits before decoding ---------------------------------------------------------
def test_bytes_limit(mp4, no_decoding):
    with pytest.raises(E.VideoTooLarge, match="bytes"):
        probe_video(mp4, VideoLimits(max_bytes=len(mp4) - 1))
    with pytest.raises(E.VideoTooLarge, match="bytes"):
        decode_video(mp4, VideoLimits(max_bytes=len(mp4) - 1))


def test_pixels_per_frame_refused_at_probe(mp4, no_decoding):
    with pytest.raises(E.VideoTooLarge, match="64x48"):
        probe_video(mp4, VideoLimits(max_pixels=64 * 48 - 1))
    with pytest.raises(E.VideoTooLarge):
        decode_video(mp4, VideoLimits(max_pixels=64 * 48 - 1), indices=[0])


def test_declared_frames_and_budgets_refused_before_decoding(mp4, no_decoding):
    with pytest.raises(E.VideoTooLarge, match="declares 8 frames"):
        probe_video(mp4, VideoLimits(max_frames=7))
    with pytest.raises(E.VideoTooLarge, match="decoded-pixel"):
        probe_video(mp4, VideoLimits(max_decoded_pixels=8 * 64 * 48 - 1))
    # Only the frames up to the last index count, and only those kept take memory.
    with pytest.raises(E.VideoTooLarge, match="decoded-pixel"):
        decode_video(mp4, VideoLimits(max_decoded_pixels=6 * 64 * 48 - 1), indices=[5])
    with pytest.raises(E.VideoTooLarge, match="output-pixel"):
        decode_video(mp4, VideoLimits(max_output_pixels=2 * 64 * 48 - 1), indices=[0, 1])


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """Two 8K frames three hours apart: a 0.4 MB file that declares hours of 8K video."""
    return encode(size=(7680, 4320), n=2, rate=1, pts=[0, 3 * 3600])


def test_video_bomb_is_refused_at_the_header(bomb, no_decoding):
    assert len(bomb) < 1_000_000
    with pytest.raises(E.VideoTooLarge, match="7680x4320"):
        probe_video(bomb, VideoLimits())
    with pytest.raises(E.VideoTooLarge, match="lasts"):
        probe_video(bomb, VideoLimits(max_pixels=8192 * 4320))
    with pytest.raises(E.VideoTooLarge):
        decode_video(bomb, VideoLimits(), indices=[0])


# limits during decoding ---------------------------------------------------------
def lying(monkeypatch, **declared):
    """Make the container declare ``declared`` instead of the truth: a lying header."""
    real = vd._header

    def header(*a):
        h = real(*a)
        return dataclasses.replace(h, **declared)
    monkeypatch.setattr(vd, "_header", header)


def test_a_stream_longer_than_declared_stops_at_the_decoded_pixel_budget(mp4, monkeypatch):
    lying(monkeypatch, frames=2, duration_s=None)
    limits = VideoLimits(max_decoded_pixels=4 * 64 * 48)
    assert probe_video(mp4, limits).frames == 2
    decoded = []
    real = vd._frames

    def counting(container, stream):
        for frame in real(container, stream):
            decoded.append(frame)
            yield frame
    monkeypatch.setattr(vd, "_frames", counting)
    with pytest.raises(E.VideoTooLarge, match="decoded-pixel"):
        decode_video(mp4, limits)
    assert len(decoded) == 5


def test_a_stream_longer_than_declared_stops_at_the_frame_limit(mp4, monkeypatch):
    lying(monkeypatch, frames=2, duration_s=None)
    with pytest.raises(E.VideoTooLarge, match="more than 3 frames"):
        decode_video(mp4, VideoLimits(max_frames=3))


def test_a_stream_that_runs_past_the_duration_limit_stops(monkeypatch):
    data = encode(n=3, rate=1, pts=[0, 1, 100])
    lying(monkeypatch, duration_s=None)
    with pytest.raises(E.VideoTooLarge, match="runs past 50 s"):
        decode_video(data, VideoLimits(max_duration_s=50))


def test_a_frame_bigger_than_declared_is_undecodable(mp4, monkeypatch):
    lying(monkeypatch, width=32)
    with pytest.raises(E.UndecodableVideo, match="64x48"):
        decode_video(mp4, VideoLimits(), indices=[0])


def test_all_frames_stop_at_the_output_budget(mp4, monkeypatch):
    lying(monkeypatch, frames=1, duration_s=None)
    with pytest.raises(E.VideoTooLarge, match="output-pixel"):
        decode_video(mp4, VideoLimits(max_output_pixels=3 * 64 * 48))


# the container's frame rate ---------------------------------------------------------
def test_a_corrupt_frame_duration_table_is_undecodable():
    """Issue 21: an stts delta of 0xffffffff (FFmpeg reads it as 1 tick) made a 16 fps H.264 MP4 16384 fps."""
    bad = with_stts_delta(video(12, size=(32, 32), rate=16, options={"bf": "0"}), 0xffffffff)
    message = "declares 16384 fps; the h264 stream.s own rate is 16 fps"
    with pytest.raises(E.UndecodableVideo, match=message):
        probe_video(bad, VideoLimits())
    with pytest.raises(E.UndecodableVideo, match=message):
        decode_video(bad, VideoLimits(), indices=[0])
    with pytest.raises(E.UndecodableVideo, match=message):
        next(vd.stream_video(bad, VideoLimits(), [0]))


def test_a_rate_above_the_ceiling_that_the_stream_does_not_carry_is_undecodable():
    bad = with_stts_delta(video(8, size=(32, 32), rate=16, codec="libvpx-vp9"), 1)
    with pytest.raises(E.UndecodableVideo, match="declares 16384 fps, above"):
        probe_video(bad, VideoLimits())


@pytest.mark.parametrize("codec,fmt,rate,delta", [
    ("libx264", "mp4", 240, None), ("libx264", "mp4", 1200, None), ("mpeg4", "mp4", 30000 / 1001, None),
    ("libvpx-vp9", "webm", 60, None), ("libvpx-vp9", "mp4", 500, None),
    ("libx264", "mp4", 16, 64),  # re-timed 16x faster than the stream says, under the ceiling: 256 fps
])
def test_true_rates_are_kept_however_high_or_retimed(codec, fmt, rate, delta):
    data = video(6, size=(32, 32), rate=rate, codec=codec, fmt=fmt)
    if delta is not None:
        data = with_stts_delta(data, delta)
        rate = 16 * 1024 / delta
    assert probe_video(data, VideoLimits()).fps == pytest.approx(rate, rel=1e-3)


# bad input ------------------------------------------------------------------------
def test_truncated_mp4_is_undecodable(mp4):
    with pytest.raises(E.UndecodableVideo):
        probe_video(mp4[: len(mp4) // 2], VideoLimits())
    with pytest.raises(E.UndecodableVideo):
        decode_video(mp4[: len(mp4) // 2], VideoLimits())


def test_truncated_webm_ends_before_the_frame_asked():
    data = encode("libvpx", "webm", n=8)
    with pytest.raises(E.UndecodableVideo):
        decode_video(data[: len(data) // 3], VideoLimits(), indices=[7])


def test_garbage_after_the_magic_is_undecodable():
    for data in (b"\x1a\x45\xdf\xa3" + bytes(200), b"\x00\x00\x00\x18ftypmp42" + b"\xff" * 200):
        with pytest.raises(E.UndecodableVideo):
            decode_video(data, VideoLimits())


def test_empty_payload_is_undecodable():
    with pytest.raises(E.UndecodableVideo):
        probe_video(b"", VideoLimits())


def test_an_audio_only_container_is_unsupported(no_decoding):
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    with pytest.raises(E.UnsupportedMedia, match="no video stream"):
        probe_video(buf.getvalue(), VideoLimits())


def test_unknown_containers_are_unsupported(no_decoding):
    gif = io.BytesIO()
    from PIL import Image
    Image.new("RGB", (8, 8)).save(gif, format="GIF")
    for data in (gif.getvalue(), b"random bytes, not a video at all", b"#EXTM3U\nfile:///etc/passwd\n"):
        with pytest.raises(E.UnsupportedMedia):
            probe_video(data, VideoLimits())


def test_a_codec_outside_the_allow_list_is_unsupported(no_decoding):
    data = encode("mjpeg", "avi", n=2, pix_fmt="yuvj420p")
    with pytest.raises(E.UnsupportedMedia, match="mjpeg"):
        probe_video(data, VideoLimits())
    with pytest.raises(E.UnsupportedMedia, match="mjpeg"):
        decode_video(data, VideoLimits())


def test_a_codec_ffmpeg_cannot_decode_is_unsupported(no_decoding):
    avi = encode("mpeg4", "avi")
    assert avi.count(b"FMP4") == 2  # the stream header's and the bitmap header's fourcc
    with pytest.raises(E.UnsupportedMedia, match="no decoder"):
        probe_video(avi.replace(b"FMP4", b"zzzz"), VideoLimits())


def test_invalid_limits_are_a_config_error():
    with pytest.raises(E.ConfigError):
        VideoLimits(max_frames=0)


# streaming ---------------------------------------------------------------------
def test_stream_yields_the_wanted_frames_ascending_once_each(mp4):
    got = list(vd.stream_video(mp4, VideoLimits(), [5, 1, 5, 3]))
    assert [i for i, _ in got] == [1, 3, 5]
    assert_colours(np.stack([f for _, f in got]), [1, 3, 5])


def test_stream_stops_decoding_after_the_last_wanted_frame(mp4, monkeypatch):
    decoded = []
    real = vd._frames

    def counting(container, stream):
        for f in real(container, stream):
            decoded.append(f)
            yield f

    monkeypatch.setattr(vd, "_frames", counting)
    assert [i for i, _ in vd.stream_video(mp4, VideoLimits(), [2])] == [2]
    assert len(decoded) == 3


def test_stream_checks_limits_before_decoding_and_errors_are_typed(mp4, bomb, no_decoding):
    with pytest.raises(E.VideoTooLarge):
        next(vd.stream_video(bomb, VideoLimits(), [0]))
    with pytest.raises(E.VideoTooLarge, match="decoded-pixel"):
        next(vd.stream_video(mp4, VideoLimits(max_decoded_pixels=6 * 64 * 48 - 1), [5]))


def test_stream_past_the_end_is_undecodable(mp4):
    with pytest.raises(E.UndecodableVideo, match="ended after 8 frames"):
        list(vd.stream_video(mp4, VideoLimits(), [0, 50]))
