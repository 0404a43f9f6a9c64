# SPDX-License-Identifier: Apache-2.0
"""EPD equals aggregated inference: a --batch-invariant reference-tower server feeds a
prefill that reproduces the logits of the aggregated transformers model run under
``batch_invariant`` bitwise (fp32), over every delivery mode, for misses, hits and
mixed batches, at any thread count and on any CPU. The default packed forward
agrees to float rounding only, and is checked with a tolerance."""

from __future__ import annotations

import contextlib
import io
import itertools
import threading
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
from epd_encoder.preprocess.registry import load_preprocessor
from epd_encoder.errors import ConfigError
from epd_encoder.models.invariant import batch_invariant
from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer.base import backends
from tests.e2e.harness import Server, png, serve_config, wait_for

# Each test sends images no other test sends, so no cache state depends on test order.
_rooms = itertools.count()


class Family:
    def __init__(self, model_dir, tower: str, invariant: bool) -> None:
        config = serve_config(model_dir)
        model = replace(config.model, tower=tower, batch_invariant=invariant)
        self.server = Server(replace(config, model=model)).start()
        self.invariant = invariant
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

    def logits(self, images, ids, items) -> tuple[torch.Tensor, torch.Tensor]:
        """(EPD, aggregated) logits; the aggregated model runs batch-invariant when the server does."""
        mode = batch_invariant(self.model) if self.invariant else contextlib.nullcontext()
        with torch.no_grad(), mode:
            want = self.model(**self.aggregated(images, ids)).logits
            got = self.model(**build_generate_kwargs(self.model, ids, items)).logits
        return got, want

    def max_diff(self, images, items) -> float:
        got, want = self.logits(images, self.prompt([it.num_tokens for it in items]), items)
        return (got - want).abs().max().item()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module", autouse=True)
def three_threads():
    # An odd intra-op thread count splits elementwise kernels off vector boundaries and
    # moves GEMM splits, so a packed batch differs from per-image runs in the last bits
    # on every CPU tried; the exact checks below must hold regardless.
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def fam(request, three_threads):
    model_dir = request.getfixturevalue("tiny_dir" if request.param == "qwen2_5_vl" else "tiny_qwen3_dir")
    f = Family(model_dir, tower="reference", invariant=True)
    yield f
    f.stop()


def check_deepstack(fam: Family, items) -> None:
    n = len(getattr(fam.model.config.vision_config, "deepstack_visual_indexes", None) or ())
    for it in items:
        assert (len(it.deepstack) if it.deepstack is not None else 0) == n


def test_inline_exact_for_misses_and_hits(fam):
    # These grids pack to GEMM row counts that differ from per-image runs on AVX2 and AVX-512.
    images = [png(11, (64, 64)), png(12, (120, 200)), png(13, (300, 90))]
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


def test_exact_when_requests_share_a_batch(fam):
    """Two requests packed into one forward (the engine held while both queue), in a
    known order: the first request's image runs with 120x200 and 300x90 after it,
    which the aggregated model never does (it encodes that request's image alone)."""
    r1 = [png(21, (64, 64))]
    r2 = [png(22, (120, 200)), png(23, (300, 90))]
    results: dict[int, list] = {}
    runtime = fam.server.runtime
    forwards, items_encoded = _batches(runtime)

    def send(i: int, imgs: list[bytes]) -> None:
        with EncodeClient(fam.server.url) as client:
            results[i] = client.encode(imgs).items

    with fam.server.paused_engine():
        threads = []
        for i, imgs in enumerate((r1, r2)):
            threads.append(threading.Thread(target=send, args=(i, imgs)))
            threads[-1].start()
            # Accepted, and queued behind the held engine.
            assert wait_for(lambda: runtime.engine.active_requests >= i + 1, timeout=30)
    for t in threads:
        t.join(30)
    after = _batches(runtime)
    assert (after[0] - forwards, after[1] - items_encoded) == (1, 3)  # one forward took all three
    for i, imgs in enumerate((r1, r2)):
        assert [it.cache for it in results[i]] == ["miss"] * len(imgs)
        assert fam.max_diff(imgs, results[i]) == 0.0


def _batches(runtime) -> tuple[int, int]:
    """(forwards run, items encoded) from the batch-size histogram."""
    samples = {s.name: s.value for s in runtime.metrics.batch_size.collect()[0].samples}
    return int(samples["epd_batch_items_count"]), int(samples["epd_batch_items_sum"])


def test_pull_exact(fam):
    images = [png(31, (120, 80)), png(32, (96, 96))]
    with EncodeClient(fam.server.url) as c:
        items = c.encode(images, delivery="pull", fetch=True).items
    check_deepstack(fam, items)
    assert fam.max_diff(images, items) == 0.0


def test_greedy_generation_identical(fam):
    images = [png(41, (64, 96)), png(42, (150, 200))]
    with EncodeClient(fam.server.url) as c:
        items = c.encode(images).items
    ids = fam.prompt([it.num_tokens for it in items])
    with torch.no_grad(), batch_invariant(fam.model):
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
    k = backends().index(backend)
    images = [png(100 + 3 * k + j, size) for j, size in enumerate([(80, 112), (120, 80), (64, 96)])]
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
                    assert [m["cache"] for m in meta] == ["pending"] * 3
                else:
                    assert [m["cache"] for m in meta] == ["hit"] * 3
                # The prompt is built from the 202 metadata, before the tensors land.
                ids = fam.prompt([m["num_tokens"] for m in meta])
                items = rx.wait(room, timeout=30)
                assert [it.num_tokens for it in items] == [m["num_tokens"] for m in meta]
                check_deepstack(fam, items)
                got, want = fam.logits(images, ids, items)
                assert (got - want).abs().max().item() == 0.0, f"round {round_}"
    finally:
        rx.close()


@pytest.mark.parametrize("family_dir", ["tiny_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("tower", ["fast", "reference"])
def test_default_packed_forward_within_tolerance(request, family_dir, tower):
    # Without --batch-invariant a packed forward runs other GEMM shapes than the
    # aggregated model (and the fast tower also fuses and reorders float sums), so
    # the logits agree to rounding (measured ~1e-6), not bitwise.
    f = Family(request.getfixturevalue(family_dir), tower=tower, invariant=False)
    try:
        images = [png(51, (64, 96)), png(52, (120, 80)), png(53, (150, 200))]
        with EncodeClient(f.server.url) as c:
            items = c.encode(images).items
        diff = f.max_diff(images, items)
        assert diff <= 1e-4, diff
    finally:
        f.stop()
