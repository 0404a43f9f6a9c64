# SPDX-License-Identifier: Apache-2.0
"""Video through a real server: metadata, delivery modes, keys, chunking, hostile input."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from epd_encoder.client import EncodeClient, image_item, video_item
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.registry import load_vision_model
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.preprocess.registry import load_video_preprocessor
from epd_encoder.preprocess.video import VideoOptions
from epd_encoder.preprocess.video_decode import VideoLimits, decode_video, probe_video
from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, b64, png, serve_config
from tests.e2e.videos import video, with_stts_delta


class Reference:
    """The tower on the video preprocessor's pixels, outside the server."""

    def __init__(self, model_dir) -> None:
        self.pre = load_video_preprocessor(model_dir)
        self.executor = VisionExecutor(load_vision_model(model_dir, progress=False).tower)

    def plan(self, data: bytes, **options):
        return self.pre.plan(probe_video(data, VideoLimits()), self.pre.resolve(VideoOptions(**options)))

    def embedding(self, data: bytes, **options) -> torch.Tensor:
        plan = self.plan(data, **options)
        staged = self.pre.stage(decode_video(data, VideoLimits(), plan.indices), plan)
        return self.executor.encode([self.pre.finish(staged)])[0].embedding


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return Reference(tiny_dir)


def inline(client, items, **extra):
    r = client.post("/v1/encode", json={"items": items, **extra})
    assert r.status_code == 200, r.text
    return unpack_inline(r.content)[1]


def vitem(data: bytes) -> dict:
    return {"type": "video", "video": b64(data)}


def test_a_video_is_encoded_as_the_tower_encodes_its_reference_pixels(client, ref):
    assert client.get("/v1/models").json()["data"][0]["modalities"] == ["image", "video"]
    data = video(24, seed=1)
    ((meta, out),) = inline(client, [vitem(data)])
    plan = ref.plan(data)
    assert meta.modality == "video" and meta.grid_thw == plan.grid_thw and plan.grid_thw[0] > 1
    assert meta.num_tokens == plan.num_tokens == out.embedding.shape[0]
    assert meta.video["frames_indices"] == list(plan.indices[:plan.sampled])
    assert meta.video["fps"] == pytest.approx(10.0)
    assert meta.video["second_per_grid_ts"] == pytest.approx(plan.second_per_grid_ts)  # Qwen2.5-VL
    torch.testing.assert_close(out.embedding, ref.embedding(data), atol=1e-5, rtol=0)


def test_mixed_image_and_video_agree_across_inline_pull_and_push(server, ref):
    data, image = video(16, seed=2), png(2)
    items = [image_item(image), video_item(data)]
    with EncodeClient(server.url) as c:
        inl = c.encode(items)
        pulled = c.encode(items, delivery="pull", fetch=True)
        with EmbeddingReceiver(backend="tcp", pool_bytes=8 << 20) as rx:
            pushed_meta = c.encode(items, delivery=rx.delivery("video-room"))
            pushed = rx.wait("video-room", timeout=30)
    want = ref.embedding(data)
    for result in (inl.items, pulled.items, pushed):
        assert [it.modality for it in result] == ["image", "video"]
        assert result[1].video["frames_indices"] == inl.items[1].video["frames_indices"]
        torch.testing.assert_close(result[1].embedding, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(result[0].embedding, inl.items[0].embedding, atol=0, rtol=0)
    # The 202 already carries what a prefill needs to place the video's tokens.
    assert pushed_meta.items[1].modality == "video" and pushed_meta.items[1].video == inl.items[1].video


def test_sampling_options_are_in_the_key(client):
    data = video(30, seed=3)
    (first,) = inline(client, [vitem(data)], video_options={"fps": 2})
    (again,) = inline(client, [vitem(data)], video_options={"fps": 2.0})
    (faster,) = inline(client, [vitem(data)], video_options={"fps": 4})
    (capped,) = inline(client, [vitem(data)], video_options={"fps": 4, "max_frames": 4})
    assert again[0].cache == "hit" and again[0].key == first[0].key
    assert faster[0].cache == "miss" and faster[0].key != first[0].key
    assert capped[0].key not in (first[0].key, faster[0].key)
    assert len(faster[0].video["frames_indices"]) > len(first[0].video["frames_indices"])
    assert len(capped[0].video["frames_indices"]) == 4


@pytest.mark.parametrize("frames,rate,options,sampled", [(17, 8, {"fps": 7, "max_frames": 14}, 14),
                                                          (367, 24, {"max_frames": 768}, 30)])
def test_a_video_whose_float32_step_overshoots_is_served(client, ref, frames, rate, options, sampled):
    """Issue 21: transformers' float32 arange gives these lengths one index past the last frame."""
    data = video(frames, size=(32, 32), rate=rate, seed=11)
    r = client.post("/v1/encode", json={"items": [vitem(data)], "video_options": options})
    assert r.status_code == 200, r.text
    ((meta, out),) = unpack_inline(r.content)[1]
    indices = meta.video["frames_indices"]
    assert len(indices) == sampled and indices == sorted(set(indices)) and indices[-1] < frames
    assert meta.video["second_per_grid_ts"] == pytest.approx(2 / (sampled / frames * rate))
    torch.testing.assert_close(out.embedding, ref.embedding(data, **options), atol=1e-5, rtol=0)


@pytest.mark.parametrize("options,status", [({"fps": 1000}, 422), ({"fps": 50}, 400),
                                            ({"max_frames": 100_000}, 400),
                                            ({"min_frames": 8, "max_frames": 4}, 400)])
def test_options_outside_the_server_bounds_are_refused(client, options, status):
    r = client.post("/v1/encode", json={"items": [vitem(video(4, seed=4))], "video_options": options})
    assert r.status_code == status, r.text


def test_a_long_video_is_encoded_in_chunks_equal_to_the_whole(tiny_dir, ref):
    data = video(40, seed=5)
    plan = ref.plan(data, fps=8)
    t, h, w = plan.grid_thw
    config = serve_config(tiny_dir)
    budget = 3 * h * w  # three temporal groups per forward
    sched = replace(config.engine.scheduler, max_batch_cost=budget)
    srv = Server(replace(config, engine=replace(config.engine, scheduler=sched))).start()
    grids, real = [], srv.runtime.executor.encode
    srv.runtime.executor.encode = lambda items: grids.extend(i.grid_thw for i in items) or real(items)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            ((meta, out),) = inline(c, [vitem(data)], video_options={"fps": 8})
    finally:
        srv.stop()
    assert t > 3 and grids == [(min(3, t - a), h, w) for a in range(0, t, 3)]
    assert meta.grid_thw == plan.grid_thw and out.embedding.shape[0] == plan.num_tokens
    torch.testing.assert_close(out.embedding, ref.embedding(data, fps=8), atol=1e-5, rtol=0)


NO_B = {"bf": "0"}


def bomb() -> bytes:
    from tests.preprocess.test_video_decode import encode

    return encode(size=(7680, 4320), n=2, rate=1, pts=[0, 3 * 3600])


@pytest.mark.parametrize("make,status,code", [
    (bomb, 413, "video_too_large"),
    (lambda: video(12, seed=6)[:3000], 400, "undecodable_video"),
    (lambda: video(4, seed=7, codec="mjpeg", fmt="avi", pix_fmt="yuvj420p"), 415, "unsupported_media"),
    (lambda: b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64, 400, "undecodable_video"),
    (lambda: b"not a video at all", 415, "unsupported_media"),
    (lambda: with_stts_delta(video(12, rate=16, seed=12, options=NO_B), 0xffffffff), 400, "undecodable_video"),  # 16384 fps
])
def test_hostile_videos_get_typed_errors_and_the_server_keeps_serving(client, make, status, code):
    r = client.post("/v1/encode", json={"items": [vitem(make()), image_item(png(7))]})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert client.get("/health").status_code == 200
    ((meta, _),) = inline(client, [vitem(video(8, seed=8))])
    assert meta.modality == "video"


def test_a_model_without_video_refuses_video_items_with_415(tmp_path):
    model_dir = write_tiny_model("internvl", tmp_path / "internvl")
    srv = Server(serve_config(model_dir)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/v1/models").json()["data"][0]["modalities"] == ["image"]
            r = c.post("/v1/encode", json={"items": [vitem(video(4, seed=9))]})
            assert r.status_code == 415 and "video" in r.json()["error"]["message"]
            assert c.post("/v1/encode", json={"items": [image_item(png(9))]}).status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_qwen3_families_answer_per_patch_timestamps(tmp_path, family):
    model_dir = write_tiny_model(family, tmp_path / family)
    ref = Reference(model_dir)
    data = video(30, seed=10)
    srv = Server(serve_config(model_dir)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            ((meta, out),) = inline(c, [vitem(data)])
    finally:
        srv.stop()
    plan = ref.plan(data)
    assert meta.grid_thw == plan.grid_thw and plan.grid_thw[0] > 1
    assert meta.video["timestamps"] == pytest.approx(list(plan.timestamps)) and len(plan.timestamps) == plan.grid_thw[0]
    assert "second_per_grid_ts" not in meta.video
    torch.testing.assert_close(out.embedding, ref.embedding(data), atol=1e-5, rtol=0)
    assert (out.deepstack is not None) == (family == "qwen3_vl")
