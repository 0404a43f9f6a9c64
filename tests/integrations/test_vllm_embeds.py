# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.32 takes our embeddings in the request (``image_embeds`` / ``video_embeds``), proven
against the real engine (tests/integrations/vllm_harness.py).

A real epd-encoder server encodes the media. vLLM runs a copy of the checkpoint whose vision
weights are noise and is given our embeddings (epd_encoder.integrations.handoff); its prompt
and sample logprobs equal vLLM's own aggregated run on the true checkpoint, which encodes the
same media itself, within 1e-5 in fp32. A control run shows the noise tower alone changes them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch
from PIL import Image

from epd_encoder.client import EncodeClient, image_item
from epd_encoder.integrations import vllm_multi_modal_data
from epd_encoder.models.tiny import write_tiny_model
from tests.e2e.harness import Server, png, serve_config
from tests.integrations.vllm_harness import VllmLLM, compare, image_ref, noise_tower_copy, require_vllm

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]
TOL = 1e-5  # fp32; the two runs differ in who ran the tower (our server vs vLLM's)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def chat(body: str) -> str:
    return f"<|im_start|>user\n{body}Describe.<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Setup:
    family: str
    server: Server
    true: VllmLLM
    noise: VllmLLM
    tmp: object


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    require_vllm()
    family = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-{family}")
    true_dir = write_tiny_model(family, tmp / "true", vllm_compatible=True)
    noise_dir = noise_tower_copy(true_dir, tmp / "noise", family)
    true, noise = VllmLLM(true_dir), VllmLLM(noise_dir)  # both start at once
    server = Server(serve_config(true_dir)).start()
    try:
        true.wait_ready()
        noise.wait_ready()
        yield Setup(family, server, true, noise, tmp)
    finally:
        server.stop()
        true.close()
        noise.close()


def image_files(tmp, images: list[bytes]) -> list[dict]:
    refs = []
    for i, data in enumerate(images):
        path = tmp / f"img-{len(data)}-{i}.png"
        path.write_bytes(data)
        refs.append(image_ref(path))
    return refs


def tensor_refs(mm: dict) -> tuple[dict, dict]:
    """``multi_modal_data`` with every tensor replaced by a ``@t:`` name, and the tensors."""
    tensors, spec = {}, {}
    for modality, fields in mm.items():
        spec[modality] = {}
        for k, v in fields.items():
            name = f"{modality}.{k}"
            tensors[name] = v
            spec[modality][k] = f"@t:{name}"
    return spec, tensors


IMAGES = [png(101, (96, 128)), png(102, (150, 60)), png(103, (224, 224))]


def test_image_embeds_equal_vllm_on_the_true_checkpoint(setup):
    with EncodeClient(setup.server.url) as c:
        items = c.encode([image_item(b) for b in IMAGES]).items
    prompt = chat("".join(f"Picture {i + 1}: {IMAGE}\n" for i in range(len(IMAGES))))
    spec, tensors = tensor_refs(vllm_multi_modal_data(items))
    pixels = {"prompt": prompt, "multi_modal_data": {"image": image_files(setup.tmp, IMAGES)}}
    want = setup.true.generate([pixels], max_tokens=8)[0]
    got = setup.noise.generate([{"prompt": prompt, "multi_modal_data": spec}], tensors, max_tokens=8)[0]
    control = setup.noise.generate([pixels], max_tokens=8)[0]
    d, c = compare(got, want), compare(control, want)
    print(f"{setup.family} image_embeds: {d}; noise tower alone: {c}")
    assert d["same_prompt"] and d["same_tokens"], (got, want)
    assert d["prompt"] <= TOL and d["sample"] <= TOL, d
    assert c["prompt"] > 1e-3, c  # the noise tower alone answers otherwise
