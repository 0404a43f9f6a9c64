# SPDX-License-Identifier: Apache-2.0
import json
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from epd_encoder.models.tiny import (
    CHECKPOINT_VISION_PREFIXES,
    FAMILIES,
    default_model_dir,
    make_tiny_model_main,
    tiny_config,
    write_tiny_model,
)


def _tensors(d):
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(d / name, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


# kimi_k25: its image processor is torchvision-only; tests/models/towers/test_kimi_k25.py covers it.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "kimi_k25"])
def test_transformers_loads_and_runs_the_tiny_model(family, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    d = write_tiny_model(family, tmp_path / family, num_shards=1 if family.startswith("qwen2") else 3)
    model, info = AutoModelForImageTextToText.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()), info
    assert model.config.model_type == family
    vision = {k: t for k, t in _tensors(d).items() if k.startswith(CHECKPOINT_VISION_PREFIXES[family])}
    assert 20 < len(vision) and sum(t.numel() for t in vision.values()) * 4 < 5e6

    processor = AutoImageProcessor.from_pretrained(d)
    img = Image.fromarray(np.random.RandomState(0).randint(0, 255, (300, 500, 3), dtype=np.uint8))
    inputs = processor(images=[img], return_tensors="pt")
    tok = AutoTokenizer.from_pretrained(d)
    cfg = model.config
    if family == "internvl":
        tiles = inputs["pixel_values"].shape[0]
        assert inputs["pixel_values"].shape[1:] == (3, 448, 448) and 1 < tiles <= 7
        n = tiles * cfg.image_seq_length
        text = "a <img>" + "<IMG_CONTEXT>" * n + "</img>"
        extra = {}
    else:
        grid = inputs["image_grid_thw"][0]
        assert int(grid[1] * grid[2]) * cfg.vision_config.patch_size**2 <= 448 * 448
        n = int(grid.prod()) // 4
        text = "a <|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>"
        assert tok.convert_tokens_to_ids("<|vision_start|>") == cfg.vision_start_token_id
    ids = tok(text, return_tensors="pt").input_ids
    assert int((ids == cfg.image_token_id).sum()) == n
    if family != "internvl":
        extra = {"mm_token_type_ids": (ids == cfg.image_token_id).long()}
    with torch.no_grad():
        logits = model(input_ids=ids, **inputs, **extra).logits
    assert logits.shape == (1, ids.shape[1], cfg.text_config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("shards", [1, 3])
def test_same_seed_gives_identical_bytes(tmp_path, shards):
    a = write_tiny_model("qwen3_vl", tmp_path / "a", seed=7, num_shards=shards)
    b = write_tiny_model("qwen3_vl", tmp_path / "b", seed=7, num_shards=shards)
    c = write_tiny_model("qwen3_vl", tmp_path / "c", seed=8, num_shards=shards)
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(files) == shards
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert any((a / n).read_bytes() != (c / n).read_bytes() for n in files)


def test_sharding_separates_vision_from_lm_and_keeps_the_tensors(tmp_path):
    single = _tensors(write_tiny_model("internvl", tmp_path / "one"))
    d = write_tiny_model("internvl", tmp_path / "many", num_shards=4)
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    prefixes = CHECKPOINT_VISION_PREFIXES["internvl"]
    vision_files = {f for k, f in weight_map.items() if k.startswith(prefixes)}
    lm_files = {f for k, f in weight_map.items() if not k.startswith(prefixes)}
    assert vision_files and lm_files and not vision_files & lm_files
    assert len(vision_files | lm_files) == 4
    sharded = _tensors(d)
    assert sharded.keys() == single.keys() == weight_map.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_lm_scale_widens_only_the_lm(tmp_path):
    from transformers import AutoModelForImageTextToText

    base = _tensors(write_tiny_model("qwen2_5_vl", tmp_path / "base", seed=3))
    d = write_tiny_model("qwen2_5_vl", tmp_path / "big", seed=3, lm_scale=50, num_shards=2)
    big = _tensors(d)
    assert big.keys() == base.keys()
    for k in base:
        if k.startswith("visual."):
            assert torch.equal(big[k], base[k]), k
        elif "mlp.up_proj" in k:
            assert big[k].shape[0] == 50 * base[k].shape[0] and not big[k].any()
    config = json.loads((d / "config.json").read_text())
    assert config["text_config"]["intermediate_size"] == 50 * 96
    lm_file = d / "model-00002-of-00002.safetensors"
    assert lm_file.stat().st_blocks * 512 < lm_file.stat().st_size  # zeros are holes
    _, info = AutoModelForImageTextToText.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()), info


def test_tiny_configs_are_small_but_exercise_the_family_features():
    q25 = tiny_config("qwen2_5_vl").vision_config
    assert 2 <= q25.depth <= 4 and set(q25.fullatt_block_indexes) < set(range(q25.depth))
    assert q25.window_size % (q25.patch_size * q25.spatial_merge_size) == 0
    assert q25.window_size < 448  # a max-size image spans several windows
    q3 = tiny_config("qwen3_vl").vision_config
    assert q3.deepstack_visual_indexes and max(q3.deepstack_visual_indexes) < q3.depth
    iv = tiny_config("internvl").vision_config
    assert tuple(iv.image_size) == (448, 448)
    with pytest.raises(ValueError, match="unknown tiny family"):
        tiny_config("llava")


def test_default_model_dir_generates_once_and_is_safe_concurrently(tmp_path, monkeypatch):
    results, errors = [], []

    def use():
        try:
            results.append(default_model_dir("qwen2_vl", seed=1, cache_dir=tmp_path))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    path = results[0]
    assert path.parent == tmp_path / "tiny" and path.name.startswith("qwen2_vl-s1-v")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp dirs left
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("EPD_ENCODER_CACHE", str(tmp_path))
    assert default_model_dir("qwen2_vl", seed=1) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_cli_writes_a_sharded_checkpoint(tmp_path, capsys):
    out = tmp_path / "cli"
    assert make_tiny_model_main(["--family", "qwen2_vl", str(out), "--seed", "2", "--shards", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "preprocessor_config.json").is_file() and (out / "tokenizer.json").is_file()
    ref = write_tiny_model("qwen2_vl", tmp_path / "ref", seed=2, num_shards=2)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()


def test_rewriting_a_directory_replaces_the_previous_layout(tmp_path):
    d = write_tiny_model("qwen2_vl", tmp_path / "d", num_shards=3)
    write_tiny_model("qwen2_vl", d, num_shards=1)
    assert sorted(p.name for p in d.glob("model*")) == ["model.safetensors"]
