# SPDX-License-Identifier: Apache-2.0
"""EPD equals aggregated inference: the encode server feeds a prefill that reproduces
the aggregated transformers model's logits bitwise (fp32), over every delivery mode."""

from __future__ import annotations

import io
import itertools
from dataclasses import replace

import httpx
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from epd_encoder.client import EncodeClient, image_item
from epd_encoder.prefill import (
    build_generate_kwargs,
    build_prefill_inputs,
    expand_image_placeholders,
    greedy_generate,
)
from epd_encoder.preprocess.base import load_preprocessor
from epd_encoder.errors import ConfigError
from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer.base import backends
from tests.e2e.harness import Server, png, serve_config

# Different sizes, different grids; 64x96 has only 6 tokens (the smallest GEMMs).
A, B, C, D = png(1, (64, 96)), png(2, (120, 80)), png(3, (150, 200)), png(4, (96, 96))
_rooms = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def single_threaded():
    # Few-row CPU GEMMs split their reduction across threads, so a packed tower
    # forward equals per-image runs bitwise only single-threaded; the server may
    # batch a request's images apart, or serve hits encoded in other batches.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Family:
    def __init__(self, model_dir, tower: str) -> None:
        config = serve_config(model_dir)
        self.server = Server(replace(config, model=replace(config.model, tower=tower))).start()
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.pre = load_preprocessor(model_dir)

    def prompt(self, num_tokens, text: str = "Compare these pictures.") -> torch.Tensor:
        """The prefill's prompt, expanded from the encode metadata alone."""
        vision = "<|vision_start|><|image_pad|><|vision_end|>"
        body = "".join(f"Picture {i + 1}: {vision}\n" for i in range(len(num_tokens)))
        ids = self.tok(f"<|im_start|>user\n{body}{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        return torch.tensor([expand_image_placeholders(ids, num_tokens, self.model.config.image_token_id)])

    def aggregated(self, images, ids) -> dict:
        """What the HF processor hands the aggregated model for the same request."""
        pre = [self.pre.preprocess(Image.open(io.BytesIO(b)).convert("RGB")) for b in images]
        return {
            "input_ids": ids,
            "pixel_values": torch.cat([p.pixel_values for p in pre]),
            "image_grid_thw": torch.tensor([p.grid_thw for p in pre]),
            "mm_token_type_ids": (ids == self.model.config.image_token_id).int(),
        }

    def max_diff(self, images, items) -> float:
        ids = self.prompt([it.num_tokens for it in items])
        with torch.no_grad():
            want = self.model(**self.aggregated(images, ids)).logits
            got = self.model(**build_generate_kwargs(self.model, ids, items)).logits
        return (got - want).abs().max().item()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def fam(request, single_threaded):
    model_dir = request.getfixturevalue("tiny_dir" if request.param == "qwen2_5_vl" else "tiny_qwen3_dir")
    f = Family(model_dir, tower="reference")
    yield f
    f.stop()


def check_deepstack(fam: Family, items) -> None:
    n = len(getattr(fam.model.config.vision_config, "deepstack_visual_indexes", None) or ())
    for it in items:
        assert (len(it.deepstack) if it.deepstack is not None else 0) == n


def test_inline_exact_for_misses_and_hits(fam):
    # Images no other test sends, so the cache states do not depend on test order.
    images = [png(11, (64, 96)), png(12, (120, 80)), png(13, (150, 200))]
    mixed_images = [images[2], png(14, (96, 96)), images[0]]  # two hits from another batch, one new
    with EncodeClient(fam.server.url) as client:
        first = client.encode(images).items
        again = client.encode(images).items
        mixed = client.encode(mixed_images).items
    assert [it.cache for it in first] == ["miss"] * 3
    assert [it.cache for it in again] == ["hit"] * 3
    assert [it.cache for it in mixed] == ["hit", "miss", "hit"]
    check_deepstack(fam, first)
    assert fam.max_diff(images, first) == 0.0
    assert fam.max_diff(images, again) == 0.0
    assert fam.max_diff(mixed_images, mixed) == 0.0


def test_pull_exact(fam):
    images = [B, D]
    with EncodeClient(fam.server.url) as c:
        items = c.encode(images, delivery="pull", fetch=True).items
    check_deepstack(fam, items)
    assert fam.max_diff(images, items) == 0.0


def test_greedy_generation_identical(fam):
    images = [A, C]
    with EncodeClient(fam.server.url) as c:
        items = c.encode(images).items
    ids = fam.prompt([it.num_tokens for it in items])
    with torch.no_grad():
        opts = {"max_new_tokens": 5, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
        want = fam.model.generate(**fam.aggregated(images, ids), **opts)
        got = fam.model.generate(**build_generate_kwargs(fam.model, ids, items), **opts)
    mine, mine_logits = greedy_generate(fam.model, build_prefill_inputs(fam.model, ids, items), 5,
                                        return_logits=True)
    assert want.sequences.shape[1] == ids.shape[1] + 5
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits, 1), torch.stack(want.logits, 1))
    assert torch.equal(mine, want.sequences[:, ids.shape[1]:])
    assert torch.equal(mine_logits, torch.stack(want.logits, 1))


@pytest.mark.parametrize("backend", backends())
def test_push_exact_for_misses_and_hits(fam, backend):
    fresh = png(100 + backends().index(backend), (80, 112))  # unseen by this server
    images = [fresh, B, A]
    try:
        rx = EmbeddingReceiver(backend, pool_bytes=8 << 20)
    except (ImportError, ConfigError) as e:
        # Only an optional backend whose package is missing may skip; any other error fails.
        if not isinstance(e, ImportError) and not isinstance(e.__cause__, ImportError):
            raise
        pytest.skip(f"backend {backend!r} cannot import: {e}")
    try:
        with httpx.Client(base_url=fam.server.url, timeout=30) as http:
            for round_ in range(2):
                room = f"eq-{backend}-{next(_rooms)}"
                body = {"items": [image_item(b) for b in images], "delivery": rx.delivery(room)}
                r = http.post("/v1/encode", json=body)
                assert r.status_code == 202, r.text
                meta = r.json()["items"]
                if round_ == 0:
                    assert meta[0]["cache"] == "pending"
                else:
                    assert [m["cache"] for m in meta] == ["hit"] * 3
                # The prompt is built from the 202 metadata, before the tensors land.
                ids = fam.prompt([m["num_tokens"] for m in meta])
                items = rx.wait(room, timeout=30)
                assert [it.num_tokens for it in items] == [m["num_tokens"] for m in meta]
                check_deepstack(fam, items)
                with torch.no_grad():
                    want = fam.model(**fam.aggregated(images, ids)).logits
                    got = fam.model(**build_generate_kwargs(fam.model, ids, items)).logits
                assert (got - want).abs().max().item() == 0.0, f"round {round_}"
    finally:
        rx.close()


@pytest.mark.parametrize("family_dir", ["tiny_dir", "tiny_qwen3_dir"])
def test_fast_tower_within_tolerance(request, family_dir, single_threaded):
    # The fast tower fuses and reorders float sums (about 1e-7 on the embeddings),
    # so the logits agree to rounding, not bitwise; --tower reference is exact.
    f = Family(request.getfixturevalue(family_dir), tower="fast")
    try:
        images = [A, B, C]
        with EncodeClient(f.server.url) as c:
            items = c.encode(images).items
        diff = f.max_diff(images, items)
        assert diff <= 1e-4, diff
    finally:
        f.stop()
