# SPDX-License-Identifier: Apache-2.0
"""A Kimi K2.5 checkpoint served end to end: /v1/encode equals the direct executor and the
aggregated model's own image features; the pil backend is refused at start-up."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from epd_encoder.errors import ConfigError
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.preprocess.decode import decode_image
from epd_encoder.preprocess.registry import load_preprocessor
from epd_encoder.wire import unpack_inline
from tests.e2e.harness import Server, body, png, serve_config


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return write_tiny_model("kimi_k25", tmp_path_factory.mktemp("tiny") / "kimi_k25")


def test_inline_round_trip(kimi_dir):
    from transformers import AutoModelForImageTextToText

    s = Server(serve_config(kimi_dir)).start()
    try:
        images = [png(1, (64, 64)), png(2, (120, 200)), png(3, (300, 90))]
        with httpx.Client(base_url=s.url, timeout=30) as client:
            r = client.post("/v1/encode", json=body(*images))
        assert r.status_code == 200, r.text
        _, items = unpack_inline(r.content)
        rt = s.runtime
        pre = [rt.preprocessor.preprocess(decode_image(d, rt.front.decode_limits)) for d in images]
    finally:
        s.stop()
    hf = AutoModelForImageTextToText.from_pretrained(kimi_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.model.get_image_features(torch.cat([p.pixel_values for p in pre]),
                                           torch.tensor([p.grid_thw for p in pre]), return_dict=True).pooler_output
    for (meta, out), p, w in zip(items, pre, want):
        assert meta.num_tokens == p.num_tokens == w.shape[0] and list(meta.grid_thw) == list(p.grid_thw)
        assert (out.embedding - w).abs().max().item() <= 1e-4


def test_pil_backend_refused_at_start_up(kimi_dir):
    config = serve_config(kimi_dir)
    config = replace(config, model=replace(config.model, preprocess_backend="pil"))
    s = Server(config)
    try:  # the server is up, but the model never loads: the reason is the state's failure
        with pytest.raises(RuntimeError, match="torchvision-only"):
            s.start()
    finally:
        s.stop()
    with pytest.raises(ConfigError, match="--preprocess-backend 'pil'"):
        load_preprocessor(kimi_dir, backend="pil")
