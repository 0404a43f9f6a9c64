# SPDX-License-Identifier: Apache-2.0
"""EPD equals aggregated inference for video, through a real server.

A ``--batch-invariant`` reference-tower server encodes requests with images and
videos (one video long enough to be split into chunks); the prefill builds its
prompt from the answer's metadata alone (grid, timestamps, seconds per temporal
patch) and runs transformers' model on the received embeddings. The aggregated
model gets the same request as pixels (the video processor's pixel_values_videos,
equal to transformers' video processor by tests/preprocess/test_video.py) under
``batch_invariant``: the logits are equal bitwise, inline and pushed.
"""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from epd_encoder.client import EncodeClient, image_item, video_item
from epd_encoder.models.invariant import batch_invariant
from epd_encoder.prefill import build_generate_kwargs, build_prefill_inputs, expand_vision_placeholders, prefill_forward
from epd_encoder.preprocess.registry import load_preprocessor, load_video_preprocessor
from epd_encoder.preprocess.video import VideoOptions
from epd_encoder.preprocess.video_decode import VideoLimits, decode_video, probe_video
from epd_encoder.receiver import EmbeddingReceiver
from tests.e2e.harness import Server, png, serve_config
from tests.e2e.videos import video

VISION = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
          "video": "<|vision_start|><|video_pad|><|vision_end|>"}
OPTIONS = {"fps": 4}


class Family:
    def __init__(self, model_dir, budget: int | None = None) -> None:
        config = serve_config(model_dir)
        config = replace(config, model=replace(config.model, tower="reference", batch_invariant=True))
        if budget is not None:
            sched = replace(config.engine.scheduler, max_batch_cost=budget)
            config = replace(config, engine=replace(config.engine, scheduler=sched))
        self.server = Server(config).start()
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.image_pre = load_preprocessor(model_dir)
        self.video_pre = load_video_preprocessor(model_dir)

    def prompt(self, items) -> torch.Tensor:
        body = "".join(f"Item {i + 1}: {VISION[it.modality]}\n" for i, it in enumerate(items))
        ids = self.tok(f"<|im_start|>user\n{body}What happens?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        return torch.tensor([expand_vision_placeholders(ids, items, self.model.config, self.tok)])

    def aggregated(self, media: list[tuple[str, bytes]], ids: torch.Tensor) -> dict:
        cfg = self.model.config
        kw = {"input_ids": ids,
              "mm_token_type_ids": (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()}
        images = [self.image_pre.preprocess(Image.open(io.BytesIO(d)).convert("RGB")) for k, d in media if k == "image"]
        videos, seconds = [], []
        params = self.video_pre.resolve(VideoOptions(**OPTIONS))
        for kind, data in media:
            if kind == "video":
                plan = self.video_pre.plan(probe_video(data, VideoLimits()), params)
                staged = self.video_pre.stage(decode_video(data, VideoLimits(), plan.indices), plan)
                videos.append(self.video_pre.finish(staged))
                seconds.append(plan.second_per_grid_ts)
        if images:
            kw["pixel_values"] = torch.cat([p.pixel_values for p in images])
            kw["image_grid_thw"] = torch.tensor([p.grid_thw for p in images])
        if videos:
            kw["pixel_values_videos"] = torch.cat([p.pixel_values for p in videos])
            kw["video_grid_thw"] = torch.tensor([p.grid_thw for p in videos])
            if cfg.model_type == "qwen2_5_vl":
                kw["second_per_grid_ts"] = torch.tensor(seconds)
        return kw

    def check(self, media, items) -> None:
        ids = self.prompt(items)
        with torch.no_grad(), batch_invariant(self.model):
            want = self.model(**self.aggregated(media, ids)).logits
            got = self.model(**build_generate_kwargs(self.model, ids, items)).logits
        explicit, _ = prefill_forward(self.model, build_prefill_inputs(self.model, ids, items))
        assert (got - want).abs().max().item() == 0.0
        assert (explicit - want).abs().max().item() <= 1e-5  # its own mrope/scatter code: rounding only


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def fam(request):
    model_dir = request.getfixturevalue("tiny_dir" if request.param == "qwen2_5_vl" else "tiny_qwen3_dir")
    # The long video's temporal groups are 24 patches (Qwen2.5-VL) or 12 (Qwen3-VL): a
    # budget of 50 takes at most 2 or 4 of them per forward.
    f = Family(model_dir, budget=50)
    yield f
    f.server.stop()


def media_items(*media):
    return [image_item(d) if k == "image" else video_item(d) for k, d in media]


def test_video_and_mixed_requests_exact_inline(fam):
    media = [("image", png(61, (120, 80))), ("video", video(24, seed=61)), ("video", video(8, size=(64, 64), seed=62))]
    executor, grids = fam.server.runtime.executor, []
    real = executor.encode
    executor.encode = lambda items: grids.extend(tuple(i.grid_thw) for i in items) or real(items)
    try:
        with EncodeClient(fam.server.url) as c:
            first = c.encode(media_items(*media), video_options=OPTIONS).items
            again = c.encode(media_items(*media), video_options=OPTIONS).items
    finally:
        executor.encode = real
    assert [it.modality for it in first] == ["image", "video", "video"]
    t, h, w = first[1].grid_thw
    chunks = [g for g in grids if g[1:] == (h, w) and g[0] < t]
    assert sum(g[0] for g in chunks) == t and len(chunks) >= 2  # the long video went in chunks
    assert first[1].grid_thw[0] > 1 and [it.cache for it in again] == ["hit"] * 3
    fam.check(media, first)
    fam.check(media, again)


def test_video_exact_pushed_with_the_prompt_built_from_the_202(fam):
    media = [("video", video(20, seed=63)), ("image", png(63, (80, 80)))]
    with EncodeClient(fam.server.url) as c, EmbeddingReceiver("tcp", pool_bytes=8 << 20) as rx:
        meta = c.encode(media_items(*media), video_options=OPTIONS, delivery=rx.delivery("epd-video")).items
        ids = fam.prompt(meta)  # before the embeddings arrive: metadata only
        items = rx.wait("epd-video", timeout=30)
    assert torch.equal(ids, fam.prompt(items))
    fam.check(media, items)
