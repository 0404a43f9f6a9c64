# SPDX-License-Identifier: Apache-2.0
"""Frame sampling and timing against transformers' own functions, over grids of cases.

Qwen3-VL's video module imports without torchvision, so its ``sample_frames`` and
``smart_resize`` run here. Qwen2-VL's imports torchvision at the top, so its
sampler runs in a child process with the test-only torchvision side directory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import subprocess
import sys
import types

import pytest
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_qwen3_resize
from transformers.video_utils import VideoMetadata

from epd_encoder.errors import BadAspectRatio, InvalidInput
from epd_encoder.preprocess import video_sampling as vs
from epd_encoder.preprocess.video import qwen3_smart_resize

from . import tv_reference

TOTALS = [1, 2, 3, 4, 5, 7, 9, 16, 33, 45, 60, 61, 100, 121, 299, 300, 301, 1799, 1800, 7193]
SOURCE_FPS = [23.976023976023978, 24.0, 25.0, 29.97002997002997, 30.0, 60.0, 7.5]
FPS = [0.5, 1.0, 2.0, 2.5, 4.0]
FRAME_RANGES = [(4, 768), (1, 16), (8, 12), (2, 3)]


def _cases():
    return itertools.product(TOTALS, SOURCE_FPS, FPS, FRAME_RANGES)


def test_qwen3_indices_equal_transformers():
    for total, src, fps, (lo, hi) in _cases():
        hf_self = types.SimpleNamespace(fps=fps, min_frames=lo, max_frames=hi)
        ref = Qwen3VLVideoProcessor.sample_frames(hf_self, VideoMetadata(total_num_frames=total, fps=src)).tolist()
        ours = vs.qwen3_vl_indices(total, src, fps=fps, min_frames=lo, max_frames=hi)
        assert ours == ref, (total, src, fps, lo, hi)
        assert ours == sorted(set(ours)) and 0 <= ours[0] and ours[-1] <= total - 1


def test_qwen3_indices_stay_inside_the_video_over_a_sweep():
    """Qwen3-VL's linspace ends at ``total - 1`` exactly: no float-step overshoot (checked as issue 21's
    Qwen2-VL case was); equal to transformers throughout."""
    for total in [*range(1, 1200), *range(1200, 20001, 293)]:
        for src, (fps, hi) in itertools.product((24.0, 25.0, 30000 / 1001, 8.0), ((2.0, 768), (7.0, 14), (8.0, 94))):
            hf_self = types.SimpleNamespace(fps=fps, min_frames=4, max_frames=hi)
            ref = Qwen3VLVideoProcessor.sample_frames(hf_self, VideoMetadata(total_num_frames=total, fps=src))
            ours = vs.qwen3_vl_indices(total, src, fps=fps, min_frames=4, max_frames=hi)
            assert ours == ref.tolist() and ours[-1] < total, (total, src, fps, hi)


def test_qwen3_unknown_rate_assumes_24():
    hf_self = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    ref = Qwen3VLVideoProcessor.sample_frames(hf_self, VideoMetadata(total_num_frames=240, fps=None)).tolist()
    assert vs.qwen3_vl_indices(240, 0.0, fps=2, min_frames=4, max_frames=768) == ref
    assert len(ref) == 20  # 240 frames at 24 fps is 10 s


_QWEN2_SCRIPT = """
import itertools, json, sys, types
sys.path.insert(0, {root!r})
from tests.preprocess import tv_reference
tv_reference.enable()
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata
cases = json.loads(sys.stdin.read())
out = []
for total, src, fps, lo, hi, tps in cases:
    s = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4, max_frames=768)
    try:
        idx = Qwen2VLVideoProcessor.sample_frames(s, VideoMetadata(total_num_frames=total, fps=src), fps=fps,
                                                  min_frames=lo, max_frames=hi, temporal_patch_size=tps)
        out.append(idx.tolist())
    except (ZeroDivisionError, ValueError) as e:
        out.append(type(e).__name__)
print(json.dumps(out))
"""


def test_qwen2_indices_equal_transformers():
    if reason := tv_reference.missing_reason():
        pytest.skip(reason)
    cases = [[t, s, f, lo, hi, tps] for (t, s, f, (lo, hi)), tps in itertools.product(_cases(), (1, 2, 3))]
    proc = subprocess.run([sys.executable, "-c", _QWEN2_SCRIPT.format(root=str(tv_reference.ROOT))],
                          input=json.dumps(cases), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refs = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = 0
    for (total, src, fps, lo, hi, tps), ref in zip(cases, refs):
        if isinstance(ref, str):  # the reference fails: too few frames for one temporal patch
            failures += 1
            with pytest.raises(InvalidInput):
                vs.qwen2_vl_indices(total, src, fps=fps, min_frames=lo, max_frames=hi, temporal_patch_size=tps)
            continue
        ours = vs.qwen2_vl_indices(total, src, fps=fps, min_frames=lo, max_frames=hi, temporal_patch_size=tps)
        # Where its float32 step overshoots to ``total``, ours are its others (see the sweep below).
        assert ours == ref[:len(ours)] and ref[len(ours):] in ([], [total]), (total, src, fps, lo, hi, tps)
    assert 0 < failures < len(cases) // 4  # the short-video branch is exercised, not the rule


def test_qwen2_counts_are_whole_temporal_patches():
    idx = vs.qwen2_vl_indices(45, 30.0, fps=2.0, min_frames=4, max_frames=768, temporal_patch_size=2)
    assert idx == [0, 11, 22, 33]
    # 3 frames, min_frames 4: clamped to the video, floored to one patch of 2
    assert vs.qwen2_vl_indices(3, 24.0, fps=2.0, min_frames=4, max_frames=768, temporal_patch_size=2) == [0, 1]
    with pytest.raises(InvalidInput):
        vs.qwen2_vl_indices(1, 24.0, fps=2.0, min_frames=4, max_frames=768, temporal_patch_size=2)
    with pytest.raises(InvalidInput):
        vs.qwen2_vl_indices(100, 0.0, fps=2.0, min_frames=4, max_frames=768, temporal_patch_size=2)
    with pytest.raises(InvalidInput):
        vs.qwen3_vl_indices(0, 30.0, fps=2.0, min_frames=4, max_frames=768)


def test_pad_temporal_repeats_the_last_index():
    assert vs.pad_temporal([0, 5, 9], 2) == [0, 5, 9, 9]
    assert vs.pad_temporal([0, 5], 2) == [0, 5]
    assert vs.pad_temporal([3], 4) == [3, 3, 3, 3]
    with pytest.raises(InvalidInput):
        vs.pad_temporal([], 2)


def test_timestamps_equal_qwen3_processor():
    for total, src, fps, (lo, hi) in itertools.islice(_cases(), 0, None, 7):
        idx = vs.qwen3_vl_indices(total, src, fps=fps, min_frames=lo, max_frames=hi)
        for tps in (1, 2, 3):
            ref = Qwen3VLProcessor._calculate_timestamps(None, list(idx), src, tps)
            assert vs.qwen3_vl_timestamps(idx, src, tps) == ref
    assert vs.qwen3_vl_timestamps([0, 15, 29], 30.0, 2) == [0.25, (29 / 30 + 29 / 30) / 2]


def test_second_per_grid_ts_equals_sampled_fps_rule():
    for total, src, fps, (lo, hi) in itertools.islice(_cases(), 1, None, 5):
        try:
            idx = vs.qwen2_vl_indices(total, src, fps=fps, min_frames=lo, max_frames=hi, temporal_patch_size=2)
        except InvalidInput:
            continue  # fewer frames than a temporal patch; the reference divides by zero
        meta = VideoMetadata(total_num_frames=total, fps=src, frames_indices=idx)
        assert vs.second_per_grid_ts(len(idx), total, src, 2) == 2 / meta.sampled_fps
    # 300 frames at 30 fps sampled at 2 fps: 20 frames, one temporal patch per second
    assert vs.second_per_grid_ts(20, 300, 30.0, 2) == pytest.approx(1.0)


def test_qwen3_smart_resize_equals_transformers():
    sizes = [(240, 320), (97, 161), (12, 20), (1, 30), (720, 1280), (48, 640), (1080, 1920), (31, 33)]
    budgets = [(128 * 32 * 32, 32 * 32 * 768), (4096, 25165824), (4096, 4096 * 8)]
    for (h, w), frames, (lo, hi), factor in itertools.product(sizes, (2, 3, 4, 20, 768), budgets, (28, 32)):
        ref = hf_qwen3_resize(frames, h, w, temporal_factor=2, factor=factor, min_pixels=lo, max_pixels=hi)
        assert qwen3_smart_resize(frames, h, w, 2, factor, lo, hi) == ref, (h, w, frames, lo, hi)
    with pytest.raises(InvalidInput):
        qwen3_smart_resize(1, 240, 320, 2, 32, 4096, 25165824)
    with pytest.raises(BadAspectRatio):
        qwen3_smart_resize(4, 100, 30000, 2, 32, 4096, 25165824)


# (total, source fps, fps, max_frames) from issue 21: the float32 step gives num_frames + 1 indices, the last == total.
PAST_THE_END = [(367, 24.0, 2.0, 768), (17, 8.0, 7.0, 14), (96, 8.0, 8.0, 94)]


@pytest.mark.parametrize("total,src,fps,max_frames", PAST_THE_END)
def test_qwen2_indices_stay_inside_the_video(total, src, fps, max_frames):
    idx = vs.qwen2_vl_indices(total, src, fps=fps, min_frames=4, max_frames=max_frames, temporal_patch_size=2)
    want = math.floor(min(total / src * fps, max_frames) / 2) * 2
    assert len(idx) == want and idx[-1] < total
    assert idx == sorted(set(idx)) and idx[0] == 0


_QWEN2_SWEEP = """
import hashlib, json, sys, types
import numpy as np
sys.path.insert(0, {root!r})
from tests.preprocess import tv_reference
tv_reference.enable()
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata
cases, crashes = json.loads(sys.stdin.read())
s = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4, max_frames=768)
out = []
for total, src, fps, lo, hi in cases:
    try:
        idx = Qwen2VLVideoProcessor.sample_frames(s, VideoMetadata(total_num_frames=total, fps=src), fps=fps,
                                                  min_frames=lo, max_frames=hi, temporal_patch_size=2).tolist()
    except (ZeroDivisionError, ValueError) as e:
        out.append(type(e).__name__)
        continue
    inside = [i for i in idx if i < total]
    out.append([hashlib.sha1(json.dumps(inside).encode()).hexdigest(), idx[len(inside):]])
# Where the sampler overshoots, the processor itself fails on the decoded frames.
processor, crashed = Qwen2VLVideoProcessor(cap_pixels_per_frame=False), []
for total, src, fps, hi in crashes:
    try:
        processor(videos=[np.zeros((total, 56, 56, 3), np.uint8)], do_sample_frames=True, fps=fps, max_frames=hi,
                  video_metadata=[VideoMetadata(total_num_frames=total, fps=src)])
        crashed.append(None)
    except IndexError as e:
        crashed.append(str(e))
print(json.dumps([out, crashed]))
"""


def test_qwen2_indices_equal_transformers_wherever_it_samples_inside_the_video():
    """A sweep of lengths, rates and options against transformers' own sampler: equal wherever its
    indices lie inside the video; where its float32 step adds one index at ``total`` (on which its
    processor fails with IndexError), ours are its others."""
    if reason := tv_reference.missing_reason():
        pytest.skip(reason)
    rates = [24.0, 25.0, 30000 / 1001, 30.0, 60.0, 8.0]
    options = [(2.0, 4, 768), (7.0, 4, 14), (8.0, 4, 94), (0.5, 4, 768), (3.0, 8, 64)]
    totals = [*range(1, 1200), *range(1200, 20001, 61)]
    cases = [[t, s, f, lo, hi] for t in totals for s in rates for f, lo, hi in options]
    cases += [[t, s, f, 4, hi] for t, s, f, hi in PAST_THE_END]
    proc = subprocess.run([sys.executable, "-c", _QWEN2_SWEEP.format(root=str(tv_reference.ROOT))],
                          input=json.dumps([cases, PAST_THE_END]), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refs, crashed = json.loads(proc.stdout.strip().splitlines()[-1])
    overshoots = 0
    for (total, src, fps, lo, hi), ref in zip(cases, refs):
        if isinstance(ref, str):
            with pytest.raises(InvalidInput):
                vs.qwen2_vl_indices(total, src, fps=fps, min_frames=lo, max_frames=hi, temporal_patch_size=2)
            continue
        digest, past_end = ref
        ours = vs.qwen2_vl_indices(total, src, fps=fps, min_frames=lo, max_frames=hi, temporal_patch_size=2)
        assert hashlib.sha1(json.dumps(ours).encode()).hexdigest() == digest, (total, src, fps, lo, hi)
        assert past_end in ([], [total]), (total, src, fps, lo, hi, past_end)
        overshoots += past_end == [total]
    assert 100 < overshoots < len(cases) // 10  # the overshoot is exercised, and is not the rule
    assert all(c is not None and "out of bounds" in c for c in crashed), crashed
