# SPDX-License-Identifier: Apache-2.0
"""Video decoding under limits, with PyAV (which bundles FFmpeg).

The decoding step of video input: the server probes (``probe_video``) on the
preprocessing pool, plans the frames to sample from the header alone
(preprocess/video.py), then streams just those frames (``stream_video``) into the
stager one temporal patch at a time (``frame_groups``).

Limits are checked twice. ``probe_video`` checks what the container declares
(bytes, container, codec, size, duration, frame count, decoded-pixel budget)
before a single frame is decoded; ``decode_video`` checks the same again and
counts the frames and pixels it actually decodes, so a stream that lies in its
header stops at the limit. Frames are converted to RGB as the transformers PyAV
reader does (``to_ndarray(format="rgb24")``), and only the requested ones are.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import av
import numpy as np

if TYPE_CHECKING:
    import torch

from epd_encoder.errors import (
    ConfigError,
    EncoderError,
    InvalidInput,
    UndecodableVideo,
    UnsupportedMedia,
    VideoTooLarge,
)

__all__ = [
    "DecodedVideo", "VideoHeader", "VideoLimits", "decode_video", "probe_video", "sniff_container",
    "frame_groups", "stream_video",
]

# Source frames a streamed stage holds per resize run (frame_groups); VideoPreprocessor
# stage_bytes charges it.
STREAM_RUN_BYTES = 32 << 20
ALLOWED_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4"})
# A container rate above this is refused unless the bitstream's own rate vouches for it (within
# RATE_SLACK): a corrupt MP4 frame-duration table (a delta of 0xffffffff reads as 1 tick) lands
# at the timescale, thousands of fps, where no playback rate is.
MAX_SOURCE_FPS = 1000.0
RATE_SLACK = 4.0
_MP4_BOXES = frozenset({b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"})


@dataclass(frozen=True)
class VideoLimits:
    """Bounds on a video, checked on its header and again while decoding.

    ``max_decoded_pixels`` bounds the decoder's work: every frame decoded up to
    the last one kept counts, kept or not. ``max_output_pixels`` bounds the
    memory of the frames returned (x3 bytes, RGB).
    """

    max_bytes: int = 256 * 1024 * 1024
    max_pixels: int = 3840 * 2160  # per frame: 4K UHD
    max_duration_s: float = 3600.0
    max_frames: int = 108_000  # one hour at 30 fps
    max_decoded_pixels: int = 18_000 * 1920 * 1080  # ten minutes of 1080p at 30 fps
    max_output_pixels: int = 768 * 1920 * 1080  # Qwen's largest frame count, at 1080p

    def __post_init__(self) -> None:
        values = (self.max_bytes, self.max_pixels, self.max_duration_s, self.max_frames,
                  self.max_decoded_pixels, self.max_output_pixels)
        if any(v <= 0 for v in values):
            raise ConfigError(f"invalid video limits {self}")


@dataclass(frozen=True)
class VideoHeader:
    """What the container and stream declare; nothing here comes from decoded frames.

    ``frames`` is the declared count, 0 where the container does not say (WebM
    often does not); ``duration_s`` is ``None`` where unknown. ``fps`` is the
    container's average rate; ``stream_fps`` the rate the bitstream itself carries
    (H.264/HEVC VUI timing, MPEG-4 VOL), 0 where it carries none (VP8/9, AV1).
    """

    container: str
    codec: str
    width: int
    height: int
    fps: float
    duration_s: float | None
    frames: int
    stream_fps: float = 0.0

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def estimated_frames(self) -> int:
        """The declared count, else duration x fps (0 when neither is known)."""
        if self.frames > 0:
            return self.frames
        if self.duration_s is not None and self.fps > 0:
            return int(round(self.duration_s * self.fps))
        return 0


@dataclass(frozen=True)
class DecodedVideo:
    """``frames`` is uint8 ``[T, H, W, 3]``; ``indices[t]`` is the decode-order index of row t."""

    frames: np.ndarray
    fps: float
    indices: tuple[int, ...]
    header: VideoHeader


Sampler = Callable[[VideoHeader], Sequence[int]]


def sniff_container(data: bytes) -> str | None:
    """The FFmpeg demuxer for a supported container, named by the magic bytes, or ``None``.

    FFmpeg is never left to guess: its probe would also try demuxers such as HLS or
    concat, which open further URLs named inside the payload.
    """
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"  # also WebM
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    if data[4:8] in _MP4_BOXES:
        return "mp4"  # the mov demuxer: MP4, MOV, 3GP
    return None


def _open(data: bytes, limits: VideoLimits) -> tuple[av.container.InputContainer, av.VideoStream]:
    if not data:
        raise UndecodableVideo("empty video payload")
    if len(data) > limits.max_bytes:
        raise VideoTooLarge(f"video is {len(data)} bytes; the limit is {limits.max_bytes}")
    fmt = sniff_container(data)
    if fmt is None:
        raise UnsupportedMedia("unrecognised video container (supported: MP4/MOV, WebM/MKV, AVI)")
    try:
        container = av.open(io.BytesIO(data), mode="r", format=fmt)
    except Exception as e:
        raise UndecodableVideo(f"invalid {fmt} container: {e}") from e
    if not container.streams.video:
        media = len(container.streams.audio) + len(container.streams.subtitles) > 0
        container.close()
        # Audio only is a format we do not take; nothing but codec-less data streams is a
        # broken file (an MP4 cut inside its moov).
        if not media:
            raise UndecodableVideo(f"the {fmt} container has no readable stream")
        raise UnsupportedMedia(f"the {fmt} container has no video stream")
    return container, container.streams.video[0]


def _seconds(value: int | None, time_base: Fraction | None) -> float | None:
    if value is None or time_base is None:
        return None
    return float(value * time_base)


def _header(container: av.container.InputContainer, stream: av.VideoStream, fmt: str) -> VideoHeader:
    if stream.codec_context is None:  # FFmpeg has no decoder for the stream's codec id
        raise UnsupportedMedia("the video codec is unknown or has no decoder")
    codec = stream.codec_context.codec.canonical_name  # "av1" whichever decoder (libdav1d) runs
    rate = stream.average_rate or stream.guessed_rate
    duration = _seconds(stream.duration, stream.time_base)
    if duration is None:
        duration = _seconds(container.duration, Fraction(1, av.time_base))
    return VideoHeader(
        container=fmt, codec=codec, width=stream.codec_context.width,
        height=stream.codec_context.height, fps=float(rate) if rate else 0.0,
        duration_s=duration, frames=max(stream.frames, 0),
        stream_fps=float(stream.codec_context.framerate or 0),
    )


def _check_header(h: VideoHeader, limits: VideoLimits) -> None:
    if h.codec not in ALLOWED_CODECS:
        raise UnsupportedMedia(f"video codec {h.codec} is not supported")
    if h.width <= 0 or h.height <= 0:
        raise UndecodableVideo(f"video has an empty size {h.width}x{h.height}")
    if h.pixels > limits.max_pixels:
        raise VideoTooLarge(f"video is {h.width}x{h.height} pixels; the limit is {limits.max_pixels}")
    if h.duration_s is not None and h.duration_s > limits.max_duration_s:
        raise VideoTooLarge(f"video lasts {h.duration_s:.0f} s; the limit is {limits.max_duration_s:.0f}")
    if h.estimated_frames > limits.max_frames:
        raise VideoTooLarge(f"video declares {h.estimated_frames} frames; the limit is {limits.max_frames}")
    _check_rate(h)


def _check_rate(h: VideoHeader) -> None:
    """The container's rate feeds sampling and the timing sent to the model: one beyond any
    playback rate that the stream's own rate does not confirm is a corrupt timing table."""
    if h.fps <= MAX_SOURCE_FPS:
        return
    if h.stream_fps <= 0:
        raise UndecodableVideo(f"the {h.container} container declares {h.fps:g} fps, above {MAX_SOURCE_FPS:g}, "
                               f"and the {h.codec} stream carries no rate to confirm it")
    if h.fps > RATE_SLACK * h.stream_fps:
        raise UndecodableVideo(f"the {h.container} container declares {h.fps:g} fps; the {h.codec} stream's "
                               f"own rate is {h.stream_fps:g} fps (a corrupt frame-duration table)")


def _check_budget(frames_to_decode: int, kept: int, h: VideoHeader, limits: VideoLimits) -> None:
    if frames_to_decode * h.pixels > limits.max_decoded_pixels:
        raise VideoTooLarge(
            f"decoding {frames_to_decode} frames of {h.width}x{h.height} exceeds the "
            f"decoded-pixel limit {limits.max_decoded_pixels}")
    if kept * h.pixels > limits.max_output_pixels:
        raise VideoTooLarge(
            f"{kept} frames of {h.width}x{h.height} exceed the output-pixel limit "
            f"{limits.max_output_pixels}")


def probe_video(data: bytes, limits: VideoLimits) -> VideoHeader:
    """Parse the container and enforce ``limits`` on what it declares; decodes no frame.

    Raises ``VideoTooLarge`` (bytes, per-frame pixels, duration, frame count, or
    declared frames x pixels over the decoded-pixel budget), ``UnsupportedMedia``
    (container or codec) or ``UndecodableVideo``, exactly as ``decode_video`` would
    for the header with no indices given.
    """
    container, stream = _open(data, limits)
    with container:
        header = _header(container, stream, sniff_container(data) or "")
    _check_header(header, limits)
    _check_budget(header.estimated_frames, 0, header, limits)
    return header


def _frames(container: av.container.InputContainer, stream: av.VideoStream) -> Iterator[av.VideoFrame]:
    """The decoder's frames in presentation order; the one place frames are decoded.

    FFmpeg's default threading (slice threads, automatic count) is kept: frame threading
    ("AUTO"/"FRAME") measured 15-20% slower on 720p and 480p H.264 on 2 cores (it buffers
    frames ahead that the sampler then drops)."""
    return container.decode(stream)


def _wanted(indices: Sequence[int] | Sampler | None, header: VideoHeader) -> list[int] | None:
    if indices is None:
        return None
    chosen = list(indices(header) if callable(indices) else indices)
    if not chosen:
        raise InvalidInput("no frame indices to decode")
    if any(not isinstance(i, (int, np.integer)) or i < 0 for i in chosen):
        raise InvalidInput("frame indices must be non-negative integers")
    return [int(i) for i in chosen]


def decode_video(
    data: bytes, limits: VideoLimits, indices: Sequence[int] | Sampler | None = None,
) -> DecodedVideo:
    """Decode ``data`` to RGB frames: all of them, or those at ``indices``.

    ``indices`` is a sequence of decode-order frame indices (any order, repeats
    allowed; rows follow it), or a sampler called with the header. Decoding stops
    after the last index wanted, and only the wanted frames are converted to RGB,
    into one array sized up front: memory is bounded by the frames kept. Raises
    ``VideoTooLarge``, ``UnsupportedMedia``, ``UndecodableVideo`` (corrupt or
    truncated, or a stream that ends before an index) or ``InvalidInput`` (bad
    indices); never a PyAV exception.
    """
    container, stream = _open(data, limits)
    with container:
        header = _header(container, stream, sniff_container(data) or "")
        _check_header(header, limits)
        wanted = _wanted(indices, header)
        if wanted is None:
            _check_budget(header.estimated_frames, header.estimated_frames, header, limits)
            frames, kept = _decode_all(container, stream, header, limits)
        else:
            _check_budget(max(wanted) + 1, len(set(wanted)), header, limits)
            frames, kept = _decode_some(container, stream, header, limits, wanted)
    return DecodedVideo(frames=frames, fps=header.fps, indices=tuple(kept), header=header)


def stream_video(data: bytes, limits: VideoLimits, indices: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
    """``(index, RGB frame)`` for each distinct index of ``indices``, ascending, as the
    decoder reaches it: a consumer that resizes as frames arrive holds one frame at
    source size, not the whole clip. The same limits and errors as ``decode_video``;
    the container closes when the generator ends or is closed."""
    container, stream = _open(data, limits)
    with container:
        header = _header(container, stream, sniff_container(data) or "")
        _check_header(header, limits)
        wanted = _wanted(indices, header)
        assert wanted is not None
        distinct = sorted(set(wanted))
        # Only one source frame is held at a time here: the output budget is the stager's.
        _check_budget(distinct[-1] + 1, 1, header, limits)
        meter, want, last = _Meter(header, limits), set(distinct), distinct[-1]
        for index, frame in enumerate(_run(_frames(container, stream))):
            meter.admit(frame)
            if index in want:
                yield index, frame.to_ndarray(format="rgb24")
            if index == last:
                return
        raise UndecodableVideo(f"video ended after {meter.frames} frames; frame {last} was requested")


class _Meter:
    """Counts what the decoder really produces, whatever the header claimed."""

    def __init__(self, header: VideoHeader, limits: VideoLimits) -> None:
        self.header, self.limits = header, limits
        self.frames = self.pixels = 0

    def admit(self, frame: av.VideoFrame) -> None:
        h, lim = self.header, self.limits
        if (frame.width, frame.height) != (h.width, h.height):
            raise UndecodableVideo(
                f"frame {self.frames} is {frame.width}x{frame.height}; the stream declared "
                f"{h.width}x{h.height}")
        self.frames += 1
        self.pixels += h.pixels
        if self.frames > lim.max_frames:
            raise VideoTooLarge(f"video has more than {lim.max_frames} frames")
        if self.pixels > lim.max_decoded_pixels:
            raise VideoTooLarge(
                f"decoding passed {self.frames} frames of {h.width}x{h.height}, over the "
                f"decoded-pixel limit {lim.max_decoded_pixels}")
        if frame.time is not None and frame.time > lim.max_duration_s:
            raise VideoTooLarge(f"video runs past {lim.max_duration_s:.0f} s")


def _run(frames: Iterator[av.VideoFrame]) -> Iterator[av.VideoFrame]:
    """The decoder's frames, with its failures as ``UndecodableVideo``."""
    try:
        yield from frames
    except EncoderError:
        raise
    except Exception as e:
        raise UndecodableVideo(f"cannot decode video: {e}") from e


def _decode_all(container, stream, header: VideoHeader, limits: VideoLimits):
    meter = _Meter(header, limits)
    rows: list[np.ndarray] = []
    for frame in _run(_frames(container, stream)):
        meter.admit(frame)
        if (len(rows) + 1) * header.pixels > limits.max_output_pixels:
            raise VideoTooLarge(f"video has more frames than the output-pixel limit "
                                f"{limits.max_output_pixels} allows")
        rows.append(frame.to_ndarray(format="rgb24"))
    if not rows:
        raise UndecodableVideo("video has no decodable frame")
    return np.stack(rows), range(len(rows))


def _decode_some(container, stream, header: VideoHeader, limits: VideoLimits, wanted: list[int]):
    distinct = sorted(set(wanted))
    slot = {index: row for row, index in enumerate(distinct)}
    out = np.empty((len(distinct), header.height, header.width, 3), dtype=np.uint8)
    meter, last = _Meter(header, limits), distinct[-1]
    for index, frame in enumerate(_run(_frames(container, stream))):
        meter.admit(frame)
        if index in slot:
            out[slot[index]] = frame.to_ndarray(format="rgb24")
        if index == last:
            break
    else:
        raise UndecodableVideo(f"video ended after {meter.frames} frames; frame {last} was requested")
    if len(distinct) != len(wanted) or distinct != wanted:
        out = out[[slot[i] for i in wanted]]
    return out, wanted


def frame_groups(video: "DecodedVideo | Iterable[tuple[int, np.ndarray]]", indices: Sequence[int],
                 size: int, max_bytes: int | None = None) -> Iterator["torch.Tensor"]:
    """The frames at ``indices`` in runs of whole ``size``-frame groups, as ``[k*size, 3, H, W]``
    uint8 (channels-last views), from a decoded clip or from ``stream_video``. Streamed, a
    run holds at most ``max_bytes`` of source frames (one group at least): resizing in
    fewer, larger runs keeps the resize's threads from alternating with the decoder's on
    every group, which measured 15-25% slower than decoding first. ``max_bytes`` defaults
    to ``STREAM_RUN_BYTES``."""
    import torch

    max_bytes = STREAM_RUN_BYTES if max_bytes is None else max_bytes
    if isinstance(video, DecodedVideo):
        if tuple(video.indices) != tuple(indices) or video.frames.shape[0] != len(indices):
            raise UndecodableVideo("the decoded frames are not the planned ones")
        if video.frames.ndim != 4 or video.frames.shape[3] != 3:
            raise InvalidInput(f"frames must be [N, H, W, 3], got {tuple(video.frames.shape)}")
        yield torch.from_numpy(video.frames).permute(0, 3, 1, 2)  # no copy
        return
    # Samplers give non-decreasing indices (padding repeats the last): each position takes
    # the newest frame the stream has reached, repeats included.
    if any(b < a for a, b in zip(indices, indices[1:])):
        raise ValueError("streamed frames need non-decreasing indices")
    stream, at, frame, run, per_run = iter(video), -1, None, [], 0
    try:
        for want in indices:
            while at < want:
                try:
                    at, frame = next(stream)
                except StopIteration:
                    raise UndecodableVideo(f"the stream ended before frame {want}") from None
            if at != want:
                raise UndecodableVideo(f"the stream skipped frame {want}")
            if not per_run:
                per_run = size * max(1, max_bytes // max(1, size * frame.nbytes))
            run.append(frame)
            if len(run) == per_run:
                yield torch.from_numpy(np.stack(run)).permute(0, 3, 1, 2)
                run = []
        if run:
            yield torch.from_numpy(np.stack(run)).permute(0, 3, 1, 2)
    finally:
        close = getattr(stream, "close", None)
        if close is not None:  # a generator holding the container: release it now, not at GC
            close()
