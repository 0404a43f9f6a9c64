# SPDX-License-Identifier: Apache-2.0
"""--batch-invariant: an item's outputs are bitwise the same in any batch and alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.invariant import batch_invariant, merge_outputs, split_units
from epd_encoder.models.registry import load_vision_model
from epd_encoder.models.tiny import FAMILIES, write_tiny_model
from epd_encoder.preprocess.registry import load_preprocessor

SIZES = [(64, 64), (120, 200), (300, 90), (90, 150)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("inv")
    return {f: write_tiny_model(f, root / f) for f in FAMILIES}


def _items(model_dir, dtype):
    pre = load_preprocessor(model_dir)
    rng = np.random.default_rng(0)
    items = [pre.preprocess(Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))) for h, w in SIZES]
    return [type(it)(it.pixel_values.to(dtype), it.grid_thw, it.num_tokens) for it in items]


def _assert_same(got, want):
    assert torch.equal(got.embedding, want.embedding)
    assert (got.deepstack is None) == (want.deepstack is None)
    for g, w in zip(got.deepstack or (), want.deepstack or ()):
        assert torch.equal(g, w)


BATCHES = [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3], [2, 0, 0, 1], [0, 1, 2, 3] * 3]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tower", ["fast", "reference"])
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_equal_alone_in_every_batch(tiny, family, tower, dtype, threads):
    loaded = load_vision_model(tiny[family], tower=tower, dtype=dtype, progress=False)
    ex = VisionExecutor(loaded.tower, dtype=dtype, batch_invariant=True)
    items = _items(tiny[family], dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = [ex.encode([it])[0] for it in items]
        for batch in BATCHES:
            for i, out in zip(batch, ex.encode([items[i] for i in batch])):
                _assert_same(out, alone[i])
    finally:
        torch.set_num_threads(before)


def test_invariant_mode_agrees_with_the_packed_forward_to_rounding(tiny):
    # The default executor packs one forward; the invariant one must still agree with it
    # to float rounding (same math, other kernel shapes).
    loaded = load_vision_model(tiny["qwen2_5_vl"], progress=False)
    items = _items(tiny["qwen2_5_vl"], torch.float32)
    fast = VisionExecutor(loaded.tower).encode(items)
    inv = VisionExecutor(loaded.tower, batch_invariant=True).encode(items)
    for a, b in zip(fast, inv):
        torch.testing.assert_close(a.embedding, b.embedding, rtol=1e-5, atol=1e-5)


def test_split_units_by_temporal_group_and_by_tile():
    rows = torch.arange(2 * 4 * 4 + 1 * 2 * 2, dtype=torch.float32)[:, None].expand(-1, 3)
    units = split_units(rows, torch.tensor([[2, 4, 4], [1, 2, 2]]))
    assert [u[0].shape[0] for u in units] == [16, 16, 4]
    assert [u[1].tolist() for u in units] == [[[1, 4, 4]], [[1, 4, 4]], [[1, 2, 2]]]
    assert [u[0][0, 0].item() for u in units] == [0, 16, 32]
    assert all(u[0].is_contiguous() and u[0].storage_offset() == 0 for u in units)
    tiles = split_units(torch.zeros(3, 3, 28, 28), torch.tensor([[2, 2, 2], [1, 2, 2]]))
    assert [u[0].shape[0] for u in tiles] == [1, 1, 1]
    assert all(u[1].tolist() == [[1, 2, 2]] for u in tiles)


def test_merge_outputs_concatenates_nested_structures():
    a = (torch.ones(2, 3), [torch.zeros(2, 1)], None)
    b = (torch.full((1, 3), 2.0), [torch.ones(1, 1)], None)
    emb, deep, none = merge_outputs([a, b])
    assert emb.shape == (3, 3) and emb[2, 0] == 2.0
    assert deep[0].tolist() == [[0.0], [0.0], [1.0]] and none is None
    with pytest.raises(TypeError):
        merge_outputs([object(), object()])


@pytest.mark.parametrize("family", FAMILIES)
def test_context_makes_transformers_vision_modules_batch_invariant(tiny, family):
    """An aggregated model's packed vision call under the context equals unit-by-unit calls."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny[family], dtype=torch.float32).eval()
    items = _items(tiny[family], torch.float32)
    pixels = torch.cat([it.pixel_values for it in items])
    grid = torch.tensor([it.grid_thw for it in items])
    kwargs = {"pixel_values": pixels} if family == "internvl" else {"pixel_values": pixels, "image_grid_thw": grid}

    def features(**kw):
        out = model.model.get_image_features(**kw, return_dict=True).pooler_output
        return torch.cat([o.reshape(-1, o.shape[-1]) for o in out]) if isinstance(out, (list, tuple)) \
            else out.reshape(-1, out.shape[-1])

    with torch.inference_mode():
        with batch_invariant(model):
            packed = features(**kwargs)
            one = [features(**({"pixel_values": it.pixel_values} if family == "internvl" else
                               {"pixel_values": it.pixel_values, "image_grid_thw": torch.tensor([it.grid_thw])}))
                   for it in items]
        assert torch.equal(packed, torch.cat(one))
    # Every patch is undone on exit.
    assert all("forward" not in m.__dict__ and "forward_packed" not in m.__dict__ for m in model.modules())


_KERNEL_PATH_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from tests.models.test_invariant import _items, _assert_same
    from epd_encoder.models.executor import VisionExecutor
    from epd_encoder.models.registry import load_vision_model
    torch.set_num_threads(2)
    for dtype in {dtypes}:
        loaded = load_vision_model({model!r}, dtype=dtype, progress=False)
        ex = VisionExecutor(loaded.tower, dtype=dtype, batch_invariant=True)
        items = _items({model!r}, dtype)
        alone = [ex.encode([it])[0] for it in items]
        for i, out in zip([3, 1, 0, 2], ex.encode([items[i] for i in [3, 1, 0, 2]])):
            _assert_same(out, alone[i])
    print("ok")
""")


# A forced-down ATen capability on an AMX CPU breaks torch's own bf16 attention
# ("pack_vnni2 is only supported when avx512"), so those paths run fp32 only.
@pytest.mark.parametrize("env,dtypes", [
    ({"ATEN_CPU_CAPABILITY": "default"}, "(torch.float32,)"),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "(torch.float32,)"),
    ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "(torch.float32, torch.bfloat16)"),
])
def test_invariance_holds_on_other_cpu_kernel_paths(tiny, env, dtypes):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = _KERNEL_PATH_SCRIPT.format(root=root, model=str(tiny["qwen3_vl"]), dtypes=dtypes)
    r = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
