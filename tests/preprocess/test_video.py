# SPDX-License-Identifier: Apache-2.0
"""QwenVideoPreprocessor against transformers' torchvision video processors, on PyAV-encoded clips.

The reference reads each clip from a file through transformers' own PyAV loader and
``sample_frames`` (tv_reference.run_video_reference); we probe the same bytes, plan,
decode only the planned frames and stage. Everything must be equal: frame indices,
video_grid_thw, pixel_values_videos (torch.equal), second_per_grid_ts and timestamps.
"""

from __future__ import annotations

import io
import json
from fractions import Fraction

import av
import numpy as np
import pytest
import torch

from epd_encoder.errors import BadAspectRatio, ConfigError, InvalidInput, UndecodableVideo, UnsupportedModel
from epd_encoder.preprocess.registry import load_video_preprocessor
from epd_encoder.preprocess.video import VideoBounds, VideoOptions
from epd_encoder.preprocess.video_decode import VideoHeader, VideoLimits, decode_video, probe_video, stream_video

from . import tv_reference
from .conftest import QWEN2_CONFIG

LIMITS = VideoLimits()


def make_video(w: int, h: int, n: int, rate, codec: str = "libx264", seed: int = 0) -> bytes:
    """``n`` frames of moving gradients plus noise (texture for the resize, motion for the codec)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(n):
            base = np.stack([(x * 3 + i * 7) % 256, (y * 2 + i * 3) % 256, (x + y + i * 11) % 256], -1)
            frame = np.clip(base + rng.integers(-20, 21, (h, w, 3)), 0, 255).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


NTSC = Fraction(30000, 1001)
VIDEOS = {
    "h264_320x240_30fps_45f": make_video(320, 240, 45, 30),
    "h264_162x98_2997fps_33f": make_video(162, 98, 33, NTSC, seed=1),  # odd frame count, NTSC rate
    "h264_200x120_24fps_121f": make_video(200, 120, 121, 24, seed=2),  # 5 s: 10 frames at 2 fps
    "mpeg4_64x48_24fps_3f": make_video(64, 48, 3, 24, codec="mpeg4", seed=3),  # shorter than min_frames
    "mpeg4_20x12_25fps_9f": make_video(20, 12, 9, 25, codec="mpeg4", seed=4),  # below one patch: upscaled
    "h264_640x48_30fps_20f": make_video(640, 48, 20, 30, seed=5),  # wide
}
QWEN3_CKPT = {  # Qwen3-VL's video_preprocessor_config.json
    "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 2, "min_frames": 4,
    "max_frames": 768, "do_sample_frames": True, "resample": 3, "video_processor_type": "Qwen3VLVideoProcessor",
}
# name -> (HF processor kind, our model_type, config both sides get)
JOBS = {
    "qwen2_defaults": ("qwen2_vl", "qwen2_vl", {"fps": 2.0}),
    # Qwen2.5-VL ships only preprocessor_config.json; transformers loads the video processor from it.
    "qwen2_5_ckpt": ("qwen2_vl", "qwen2_5_vl", {**QWEN2_CONFIG, "max_pixels": 160 * 28 * 28, "fps": 3.0}),
    "qwen2_5_cap": ("qwen2_vl", "qwen2_5_vl", {"fps": 4.0, "cap_pixels_per_frame": True, "max_video_tokens": 900}),
    "qwen2_bilinear_frames": ("qwen2_vl", "qwen2_vl", {"fps": 4.0, "resample": 2, "min_frames": 8,
                                                       "max_frames": 10}),
    "qwen3_ckpt": ("qwen3_vl", "qwen3_vl", QWEN3_CKPT),
    "qwen3_defaults": ("qwen3_vl", "qwen3_5", {}),
    "qwen3_cap": ("qwen3_vl", "qwen3_5_moe", {**QWEN3_CKPT, "cap_pixels_per_frame": True, "max_video_tokens": 64}),
    "qwen3_frames": ("qwen3_vl", "qwen3_vl_moe", {**QWEN3_CKPT, "fps": 0.5, "min_frames": 6, "max_frames": 7}),
}
# Silences transformers' cap_pixels_per_frame warning; the value is its current default.
HF_KWARGS = {"cap_pixels_per_frame": False}


def _hf_config(config: dict) -> dict:
    return config if "cap_pixels_per_frame" in config else {**config, **HF_KWARGS}


@pytest.fixture(scope="module")
def tv_ref():
    if reason := tv_reference.missing_reason():
        pytest.skip(reason)
    jobs = [{"name": n, "processor": kind, "config": _hf_config(cfg), "videos": sorted(VIDEOS)}
            for n, (kind, _, cfg) in JOBS.items()]
    return tv_reference.run_video_reference(jobs, VIDEOS)


def _ours(model_type: str, config: dict, data: bytes, options: VideoOptions | None = None):
    pp = load_video_preprocessor(config, model_type)
    header = probe_video(data, LIMITS)
    plan = pp.plan(header, pp.resolve(options))
    staged = pp.stage(stream_video(data, LIMITS, plan.indices), plan)  # what the server runs
    return pp, plan, staged, pp.finish(staged)


@pytest.mark.parametrize("job", sorted(JOBS))
def test_equals_transformers(tv_ref, job):
    _, model_type, config = JOBS[job]
    for name, data in VIDEOS.items():
        ref = tv_ref[job][name]
        pp, plan, staged, out = _ours(model_type, config, data)
        assert list(plan.indices[: plan.sampled]) == ref["indices"].tolist(), name
        assert plan.total_frames == int(ref["total"]) and plan.source_fps == float(ref["fps"])
        assert list(plan.grid_thw) == ref["grid"][0].tolist(), name
        assert out.pixel_values.dtype == torch.float32
        assert torch.equal(out.pixel_values, ref["pixel_values"]), \
            f"{name}: max |diff| {(out.pixel_values - ref['pixel_values']).abs().max()}"
        assert staged.pixels.shape == (out.pixel_values.shape[0], 3, pp.temporal_patch_size, pp.patch_size,
                                       pp.patch_size)
        assert plan.num_tokens == out.num_patches // 4
        if model_type == "qwen2_5_vl":
            assert plan.second_per_grid_ts == float(ref["second_per_grid_ts"][0]) and plan.timestamps is None
        elif model_type == "qwen2_vl":
            assert plan.second_per_grid_ts is None and plan.timestamps is None
        else:
            assert list(plan.timestamps) == ref["timestamps"].tolist() and plan.second_per_grid_ts is None
        meta = json.loads(json.dumps(plan.metadata()))
        assert meta["frames_indices"] == ref["indices"].tolist() and meta["fps"] == plan.source_fps


def test_device_path_equals_host_path():
    pp, plan, staged, out = _ours("qwen3_vl", QWEN3_CKPT, VIDEOS["h264_162x98_2997fps_33f"])
    assert torch.equal(pp.finish(staged, device="cpu").pixel_values, out.pixel_values)


@pytest.mark.parametrize("model_type,config", [("qwen2_vl", {"fps": 4.0}), ("qwen3_vl", QWEN3_CKPT)])
def test_row_slices_are_the_chunks_staged_alone(model_type, config):
    """A chunk of temporal patches [a, b) is rows [a*gh*gw, b*gh*gw) with grid (b-a, gh, gw)."""
    data = VIDEOS["h264_200x120_24fps_121f"]
    pp, plan, staged, out = _ours(model_type, config, data)
    t, gh, gw = plan.grid_thw
    assert t >= 4
    decoded = decode_video(data, LIMITS, plan.indices)
    for a, b in [(0, 1), (1, 3), (t - 2, t), (0, t)]:
        sub = plan.groups(a, b)
        assert sub.grid_thw == (b - a, gh, gw) and sub.num_tokens * t == plan.num_tokens * (b - a)
        tps = pp.temporal_patch_size
        part = type(decoded)(frames=decoded.frames[a * tps:b * tps], fps=decoded.fps, indices=sub.indices,
                             header=decoded.header)
        alone = pp.stage(part, sub)
        assert torch.equal(alone.pixels, staged.pixels[a * gh * gw:b * gh * gw])
        assert torch.equal(pp.finish(alone).pixel_values, out.pixel_values[a * gh * gw:b * gh * gw])
        if plan.timestamps is not None:
            assert sub.timestamps == plan.timestamps[a:b]


def test_padding_repeats_the_last_frame():
    pp, plan, staged, _ = _ours("qwen3_vl", QWEN3_CKPT, VIDEOS["mpeg4_64x48_24fps_3f"])
    assert plan.indices == (0, 1, 2, 2) and plan.sampled == 3 and plan.grid_thw[0] == 2
    assert torch.equal(staged.pixels[-1, :, 0], staged.pixels[-1, :, 1])  # both halves of the last patch
    assert plan.metadata()["frames_indices"] == [0, 1, 2]


def test_params_resolve_and_bounds():
    pp = load_video_preprocessor({}, "qwen2_vl")
    p = pp.params()
    assert p["modality"] == "video" and p["backend"] == "torchvision" and p["version"] == 1
    assert (p["fps"], p["min_frames"], p["max_frames"]) == (2.0, 4, 768)  # fps: qwen-vl-utils' 2, not HF's None
    assert (p["min_pixels"], p["max_pixels"]) == (128 * 28 * 28, 28 * 28 * 768)
    assert p == load_video_preprocessor({"fps": 2}, "qwen2_vl").params()
    assert json.loads(json.dumps(p)) == p
    assert pp.resolve(VideoOptions()) == p
    changed = pp.resolve(VideoOptions(fps=1.0, max_frames=64, min_pixels=128 * 28 * 28, max_pixels=256 * 28 * 28))
    assert (changed["fps"], changed["max_frames"], changed["max_pixels"]) == (1.0, 64, 256 * 28 * 28)
    for bad in [VideoOptions(fps=0.0), VideoOptions(fps=100.0), VideoOptions(fps=float("nan")),
                VideoOptions(max_frames=769), VideoOptions(min_frames=0), VideoOptions(min_frames=9, max_frames=8),
                VideoOptions(max_pixels=28 * 28 * 769), VideoOptions(min_pixels=1), VideoOptions(max_frames=True),
                VideoOptions(min_pixels=2.5)]:
        with pytest.raises(InvalidInput):
            pp.resolve(bad)
    wide = load_video_preprocessor({}, "qwen3_vl", bounds=VideoBounds(max_frames=1000, fps=(0.5, 30.0),
                                                                      pixels=(1024, 1 << 26)))
    assert wide.resolve(VideoOptions(fps=24.0, max_frames=1000, max_pixels=1 << 26))["max_frames"] == 1000
    qwen3 = load_video_preprocessor({}, "qwen3_vl").params()
    assert (qwen3["patch_size"], qwen3["min_pixels"], qwen3["image_mean"]) == (16, 128 * 32 * 32, [0.5] * 3)
    assert qwen3 != p and qwen3["timing"] == "timestamps"
    with pytest.raises(ConfigError):
        load_video_preprocessor({}, "qwen3_vl", bounds=VideoBounds(max_frames=100))  # config's 768 outside
    with pytest.raises(ConfigError):
        load_video_preprocessor({"fps": 10}, "qwen3_vl")
    with pytest.raises(ConfigError):
        load_video_preprocessor({"num_frames": 16}, "qwen3_vl")


def test_qwen2_min_max_pixels_override_size_qwen3_ignores_them():
    cfg = {"min_pixels": 3136, "max_pixels": 12845056, "size": {"shortest_edge": 1, "longest_edge": 2}}
    assert load_video_preprocessor(cfg, "qwen2_5_vl").params()["max_pixels"] == 12845056
    assert load_video_preprocessor({**cfg, "size": {"shortest_edge": 4096, "longest_edge": 8192}},
                                   "qwen3_vl").params()["max_pixels"] == 8192


def test_registry_reads_checkpoints_in_transformers_order(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert load_video_preprocessor(tmp_path).params() == load_video_preprocessor({}, "qwen2_5_vl").params()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN2_CONFIG))
    assert load_video_preprocessor(tmp_path).params()["max_pixels"] == QWEN2_CONFIG["max_pixels"]
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"max_pixels": 100352 * 2}))
    assert load_video_preprocessor(tmp_path).params()["max_pixels"] == 100352 * 2
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"fps": 1.0}}))
    assert load_video_preprocessor(tmp_path).params()["fps"] == 1.0
    for model_type in ("internvl", "kimi_k25", "gemma3"):
        with pytest.raises(UnsupportedModel):
            load_video_preprocessor({}, model_type)
    with pytest.raises(ConfigError):
        load_video_preprocessor({})


def test_too_short_and_mismatched_frames_are_refused():
    one = make_video(64, 48, 1, 24, codec="mpeg4")
    for model_type in ("qwen2_vl", "qwen3_vl"):
        pp = load_video_preprocessor({}, model_type)
        with pytest.raises(InvalidInput):
            pp.plan(probe_video(one, LIMITS), pp.params())
    pp, plan, _, _ = _ours("qwen2_vl", {}, VIDEOS["h264_320x240_30fps_45f"])
    other = decode_video(VIDEOS["h264_320x240_30fps_45f"], LIMITS, [0, 1, 2, 3])
    with pytest.raises(UndecodableVideo):
        pp.stage(other, plan)
    with pytest.raises(ValueError):
        pp.plan(probe_video(one, LIMITS), load_video_preprocessor({}, "qwen3_vl").params())


def test_stage_bytes_bounds_the_staged_and_decoded_sizes(monkeypatch):
    data = VIDEOS["h264_320x240_30fps_45f"]
    pp = load_video_preprocessor({}, "qwen3_vl")
    header = probe_video(data, LIMITS)
    plan = pp.plan(header, pp.params())
    decoded = decode_video(data, LIMITS, plan.indices)
    staged = pp.stage(decoded, plan)
    assert pp.stage_bytes(header, plan, streamed=False) >= decoded.frames.nbytes + staged.pixels.numel()
    # Streamed, one run of source frames is held: far less than the clip once runs are short.
    from epd_encoder.preprocess import video_decode

    monkeypatch.setattr(video_decode, "STREAM_RUN_BYTES", 1)  # one temporal patch per run
    data = VIDEOS["h264_200x120_24fps_121f"]
    pp = load_video_preprocessor({"fps": 8.0, "max_frames": 64}, "qwen2_vl")
    header = probe_video(data, LIMITS)
    plan = pp.plan(header, pp.params())
    decoded = decode_video(data, LIMITS, plan.indices)
    staged = pp.stage(decoded, plan)
    frame = header.width * header.height * 3
    streamed = pp.stage_bytes(header, plan)
    assert staged.pixels.numel() + 2 * frame <= streamed
    assert pp.stage_bytes(header, plan, streamed=False) - streamed >= decoded.frames.nbytes - 5 * frame


@pytest.mark.parametrize("name", sorted(VIDEOS))
def test_streamed_staging_equals_staging_the_decoded_clip(name):
    data = VIDEOS[name]
    for model_type in ("qwen2_vl", "qwen3_vl"):
        pp = load_video_preprocessor({"fps": 8.0, "min_frames": 4, "max_frames": 64}, model_type)
        plan = pp.plan(probe_video(data, LIMITS), pp.params())
        whole = pp.stage(decode_video(data, LIMITS, plan.indices), plan)
        streamed = pp.stage(stream_video(data, LIMITS, plan.indices), plan)
        assert torch.equal(whole.pixels, streamed.pixels) and whole.grid_thw == streamed.grid_thw


@pytest.mark.parametrize("groups_per_run", [1, 3])
def test_streamed_staging_holds_one_run_of_source_frames(monkeypatch, groups_per_run):
    from epd_encoder.preprocess import video_decode

    data = VIDEOS["h264_200x120_24fps_121f"]
    frame = 200 * 120 * 3
    monkeypatch.setattr(video_decode, "STREAM_RUN_BYTES", groups_per_run * 2 * frame + frame // 2)
    pp = load_video_preprocessor({"fps": 8.0, "max_frames": 64}, "qwen2_vl")
    plan = pp.plan(probe_video(data, LIMITS), pp.params())
    pulled, seen = [0], []

    def counting():
        for item in stream_video(data, LIMITS, plan.indices):
            pulled[0] += 1
            yield item

    real = pp._resize
    monkeypatch.setattr(pp, "_resize", lambda group, th, tw: seen.append(pulled[0]) or real(group, th, tw))
    pp.stage(counting(), plan)
    run = pp.temporal_patch_size * groups_per_run
    # Group g is resized once its run is in, before any frame of a later run is decoded.
    assert len(seen) == plan.grid_thw[0] > 2 * groups_per_run
    assert all(n <= (g // groups_per_run + 1) * run for g, n in enumerate(seen))
    assert any(n > (g + 1) * pp.temporal_patch_size for g, n in enumerate(seen)) == (groups_per_run > 1)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_bad_aspect_ratio_names_the_source_size(model_type):
    """Issue 21: Qwen3-VL scales a 14-pixel edge up to 32 first, and the error named 6857x32."""
    pp = load_video_preprocessor({}, model_type)
    header = VideoHeader(container="mp4", codec="h264", width=3000, height=14, fps=24.0, duration_s=1.0, frames=24)
    with pytest.raises(BadAspectRatio) as e:
        pp.plan(header, pp.params())
    assert "3000x14" in str(e.value) and "6857" not in str(e.value) and "200" in str(e.value)
