# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.32 takes our embeddings in the request (``image_embeds`` / ``video_embeds``), proven
against the real engine (tests/integrations/vllm_harness.py).

A real epd-encoder server encodes the media. vLLM runs a copy of the checkpoint whose vision
weights are noise and is given our embeddings (epd_encoder.integrations.handoff); its prompt
and sample logprobs equal vLLM's own aggregated run on the true checkpoint, which encodes the
same media itself, within 1e-5 in fp32. A control run shows the noise tower alone changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from epd_encoder.client import EncodeClient, image_item, video_item
from epd_encoder.integrations import vllm_multi_modal_data
from epd_encoder.integrations.handoff import vllm_embeds_part
from epd_encoder.models.tiny import write_tiny_model
from tests.e2e.harness import Server, png, serve_config
from tests.e2e.videos import video
from tests.integrations.vllm_harness import (
    VllmLLM,
    VllmServer,
    compare,
    image_ref,
    noise_tower_copy,
    require_vllm,
    video_ref,
)

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]
# Per test, fixture start included: two or three vLLM starts at ~40 s each when idle, minutes on a loaded CI box.
pytestmark = pytest.mark.timeout(1800)
TOL = 1e-5  # fp32; the two runs differ in who ran the tower (our server vs vLLM's)
# Qwen3.5 runs in bf16 only: vLLM 0.32's CPU Gated-DeltaNet kernel asserts "CPU GDN attention
# requires BF16." (layers/mamba/ops/cpu/gdn_attention.py) and an fp32 engine dies on its first
# forward. In bf16 vLLM's tower and ours round differently, so the check there is relative: our
# embeddings must land at least CONTROL_RATIO times closer to the true run than the noise tower.
DTYPE = {"qwen3_5": "bfloat16"}
CONTROL_RATIO = 20
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
    true_dir: object
    openai: VllmServer


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    require_vllm()
    family = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-{family}")
    true_dir = write_tiny_model(family, tmp / "true", vllm_compatible=True)
    noise_dir = noise_tower_copy(true_dir, tmp / "noise", family)
    dtype = DTYPE.get(family, "float32")
    true, noise = VllmLLM(true_dir, dtype=dtype), VllmLLM(noise_dir, dtype=dtype)  # all start at once
    openai = VllmServer(noise_dir, "--dtype", dtype)  # one more start per family, beside the two
    server = Server(serve_config(true_dir)).start()
    try:
        true.wait_ready()
        noise.wait_ready()
        yield Setup(family, server, true, noise, tmp, true_dir, openai)
    finally:
        server.stop()
        for engine in (true, noise, openai):
            engine.close()


def check(setup: Setup, what: str, got: dict, want: dict, control: dict) -> None:
    """``got`` (noise tower + our embeddings) equals ``want`` (true checkpoint); ``control`` does not."""
    d, c = compare(got, want), compare(control, want)
    print(f"{setup.family} {what}: {d}; noise tower alone: {c}")
    assert d["same_prompt"], (got["prompt_token_ids"], want["prompt_token_ids"])
    assert c["prompt"] > 1e-3, c  # the noise tower alone answers otherwise
    if setup.family in DTYPE:
        assert d["prompt"] * CONTROL_RATIO <= c["prompt"], (d, c)
        return
    assert d["same_tokens"], (got, want)
    assert d["prompt"] <= TOL and d["sample"] <= TOL, d


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
            if isinstance(v, list):  # one tensor per item (Qwen3-VL video timestamps)
                tensors.update({f"{name}.{i}": t for i, t in enumerate(v)})
                spec[modality][k] = [f"@t:{name}.{i}" for i in range(len(v))]
            else:
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
    check(setup, "image_embeds", got, want, control)


VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_FPS = 4  # our sampling rate from an 8 fps clip: Qwen2.5-VL's second_per_grid_ts is then 0.5
FRAMES = 16


def sampled_frames(data: bytes, indices) -> torch.Tensor:
    from epd_encoder.preprocess.video_decode import VideoLimits, decode_video

    return torch.from_numpy(decode_video(data, VideoLimits(), list(indices)).frames.copy())


def presampled_request(prompt: str, meta: dict) -> dict:
    """vLLM's request for the frames our server sampled (tensor "frames"), marked pre-sampled, so
    vLLM's tower sees the pixels ours saw and vLLM derives the same timing from the metadata."""
    metadata = {"fps": float(meta["fps"]), "frames_indices": list(meta["frames_indices"]), "total_num_frames": FRAMES,
                "duration": FRAMES / float(meta["fps"]), "video_backend": "pyav", "do_sample_frames": False}
    return {"prompt": prompt, "multi_modal_data": {"video": [video_ref("frames", metadata)]},
            "mm_processor_kwargs": {"fps": VIDEO_FPS}}


def test_video_embeds_equal_vllm_on_the_true_checkpoint(setup):
    clip = video(FRAMES, size=(96, 64), rate=8, seed=7)
    with EncodeClient(setup.server.url) as c:
        items = c.encode([video_item(clip)], video_options={"fps": VIDEO_FPS}).items
    meta = items[0].video
    prompt = chat(f"{VIDEO}\n")
    spec, tensors = tensor_refs(vllm_multi_modal_data(items))
    tensors["frames"] = sampled_frames(clip, meta["frames_indices"])
    pixels = presampled_request(prompt, meta)
    want = setup.true.generate([pixels], tensors, max_tokens=8)[0]
    got = setup.noise.generate([{"prompt": prompt, "multi_modal_data": spec}], tensors, max_tokens=8)[0]
    control = setup.noise.generate([pixels], tensors, max_tokens=8)[0]
    check(setup, f"video_embeds {items[0].grid_thw} {meta}", got, want, control)
    if "timestamps" in spec["video"]:  # what the vLLM 0.11-era helper sent: vLLM 0.32 refuses it
        bare = {"video": {k: v for k, v in spec["video"].items() if k != "timestamps"}}
        with pytest.raises(RuntimeError, match="timestamps"):
            setup.noise.generate([{"prompt": prompt, "multi_modal_data": bare}], tensors, max_tokens=8)
    if "second_per_grid_ts" in spec["video"]:  # vLLM reads it: without it the positions move (1.0)
        bare = {"video": {k: v for k, v in spec["video"].items() if k != "second_per_grid_ts"}}
        without = setup.noise.generate([{"prompt": prompt, "multi_modal_data": bare}], tensors, max_tokens=8)[0]
        print(f"{setup.family} video_embeds without second_per_grid_ts: {compare(without, want)}")
        assert compare(without, want)["prompt"] > 1e-3


def ask_openai(setup: Setup, items, text: str) -> dict:
    """One chat request to the noise-tower OpenAI server, each item an embeddings part, through
    the ``openai`` client; the answer in ``compare``'s shape (vLLM's prompt_logprobs extension)."""
    from openai import OpenAI

    server = setup.openai.wait_ready()
    parts = [vllm_embeds_part(it, uuid=it.key) for it in items]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=8, temperature=0, logprobs=True,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    choice, prompt_ids = r.choices[0], r.model_extra["prompt_token_ids"]
    return {"prompt_token_ids": prompt_ids, "token_ids": choice.model_extra["token_ids"],
            "logprobs": [t.logprob for t in choice.logprobs.content],
            "prompt_logprobs": [None if d is None else d[str(t)]["logprob"]
                                for d, t in zip(r.model_extra["prompt_logprobs"], prompt_ids)]}


def rendered_prompt(setup: Setup, kinds: list[str], text: str) -> str:
    """The chat template rendered with plain media parts: the aggregated run's prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(setup.true_dir)
    content = [*({"type": k} for k in kinds), {"type": "text", "text": text}]
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def test_openai_server_takes_image_embeds_content_parts(setup):
    """``python -m vllm.entrypoints.openai.api_server`` on the noise tower, asked through the
    ``openai`` client with ``image_embeds`` parts (vllm_embeds_part), answers as LLM.generate does
    on the true checkpoint with the images as pixels."""
    with EncodeClient(setup.server.url) as c:
        items = c.encode([image_item(b) for b in IMAGES[:2]]).items
    got = ask_openai(setup, items, "Compare them.")
    prompt = rendered_prompt(setup, ["image", "image"], "Compare them.")
    request = {"prompt": prompt, "multi_modal_data": {"image": image_files(setup.tmp, IMAGES[:2])}}
    want = setup.true.generate([request], max_tokens=8)[0]
    control = setup.noise.generate([request], max_tokens=8)[0]
    check(setup, "OpenAI image_embeds parts", got, want, control)


def test_openai_server_takes_video_embeds_content_parts(setup):
    """The same with a ``video_embeds`` part (Qwen2.5-VL: ``second_per_grid_ts`` as a tensor;
    Qwen3-VL, Qwen3.5: ``timestamps`` as a JSON array, deepstack concatenated)."""
    clip = video(FRAMES, size=(96, 64), rate=8, seed=9)
    with EncodeClient(setup.server.url) as c:
        items = c.encode([video_item(clip)], video_options={"fps": VIDEO_FPS}).items
    got = ask_openai(setup, items, "What happens?")
    prompt = rendered_prompt(setup, ["video"], "What happens?")
    meta = items[0].video
    tensors = {"frames": sampled_frames(clip, meta["frames_indices"])}
    want = setup.true.generate([presampled_request(prompt, meta)], tensors, max_tokens=8)[0]
    control = setup.noise.generate([presampled_request(prompt, meta)], tensors, max_tokens=8)[0]
    check(setup, "OpenAI video_embeds parts", got, want, control)
