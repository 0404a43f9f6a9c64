# SPDX-License-Identifier: Apache-2.0
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from epd_encoder.errors import CheckpointError
from epd_encoder.models.loading.checkpoint import read_checkpoint
from epd_encoder.models.loading.loader import load_strict, load_vision_weights
from epd_encoder.models.tiny import CHECKPOINT_VISION_PREFIXES, FAMILIES, write_tiny_model

QWEN = (("visual.", ""), ("model.visual.", ""))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "single": write_tiny_model("qwen2_5_vl", root / "single", seed=1),
        "sharded": write_tiny_model("qwen2_5_vl", root / "sharded", seed=1, num_shards=4),
    }


def _saved(d: Path) -> dict[str, torch.Tensor]:
    info = read_checkpoint(d)
    out = {}
    for file in info.weight_files:
        with safe_open(d / file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_loads_only_vision_tensors_with_prefixes_stripped(ckpts, layout):
    saved = _saved(ckpts[layout])
    state, report = load_vision_weights(ckpts[layout], QWEN, progress=False)
    vision = {k[len("visual."):]: t for k, t in saved.items() if k.startswith("visual.")}
    assert len(vision) < len(saved)  # the checkpoint does hold LM tensors
    assert state.keys() == vision.keys()
    assert all(torch.equal(state[k], vision[k]) for k in vision)
    assert "patch_embed.proj.weight" in state and not any(k.startswith("visual") for k in state)
    assert report.tensors == len(vision)
    assert report.bytes == sum(t.numel() * t.element_size() for t in vision.values())
    if layout == "single":
        assert report.shards_opened == ["model.safetensors"] and report.shards_skipped == []
    else:
        assert report.shards_opened == ["model-00001-of-00004.safetensors"]
        assert len(report.shards_skipped) == 3


def test_first_matching_prefix_wins_and_collisions_are_errors(ckpts, tmp_path):
    prefixes = (("visual.merger.", "projector."), ("visual.", "tower."))
    state, _ = load_vision_weights(ckpts["single"], prefixes, progress=False)
    assert any(k.startswith("projector.") for k in state)
    assert not any(k.startswith("tower.merger.") for k in state)
    assert any(k.startswith("tower.blocks.") for k in state)
    (tmp_path / "config.json").write_text("{}")
    save_file({k: torch.zeros(2) for k in ("visual.a", "model.visual.a", "lm.b")}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.visual.a' and 'visual.a' both map to 'a'"):
        load_vision_weights(tmp_path, QWEN, progress=False)


def test_casts_floating_tensors_to_the_served_dtype(ckpts):
    ref, _ = load_vision_weights(ckpts["sharded"], QWEN, progress=False)
    state, report = load_vision_weights(ckpts["sharded"], QWEN, dtype=torch.bfloat16, progress=False)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert report.bytes == sum(t.numel() * 4 for t in ref.values())  # read as fp32
    assert all(torch.equal(state[k], ref[k].to(torch.bfloat16)) for k in ref)


# kimi_k25 keeps the checkpoint layout (fused wqkv), which transformers converts on load;
# tests/models/towers/test_kimi_k25.py compares through that conversion.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "kimi_k25"])
def test_loaded_weights_fit_transformers_own_vision_modules(family, tmp_path):
    from transformers import AutoModelForImageTextToText

    d = write_tiny_model(family, tmp_path / family, num_shards=3)
    hf = AutoModelForImageTextToText.from_pretrained(d)
    if family == "internvl":
        module = torch.nn.ModuleDict(
            {"tower": hf.model.vision_tower, "projector": hf.model.multi_modal_projector}
        )
        prefixes = (("vision_tower.", "tower."), ("multi_modal_projector.", "projector."))
    else:
        module = hf.model.visual
        prefixes = tuple((p, "") for p in CHECKPOINT_VISION_PREFIXES[family])
    reference = {k: v.clone() for k, v in module.state_dict().items()}
    for p in module.parameters():
        p.data.zero_()
    state, report = load_vision_weights(d, prefixes, progress=False)
    load_strict(module, state)
    assert all(torch.equal(module.state_dict()[k], reference[k]) for k in reference)
    assert report.shards_skipped  # the LM shards


def test_strict_load_names_missing_unexpected_and_mismatched_keys():
    module = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(30)])
    good = {k: torch.ones_like(v) for k, v in module.state_dict().items()}
    load_strict(module, good)
    assert torch.equal(module[0].weight, torch.ones(2, 2))

    bad = dict(good)
    del bad["0.weight"]
    bad["extra.weight"] = torch.zeros(1)
    bad["1.bias"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as err:
        load_strict(module, bad)
    msg = str(err.value)
    assert "missing: 0.weight (1)" in msg and "unexpected: extra.weight (1)" in msg
    assert "1.bias (3,) vs module (2,)" in msg

    many = {k: v for k, v in good.items() if not k.endswith("weight")}
    with pytest.raises(CheckpointError, match=r"\(30 in all\)") as err:
        load_strict(module, many)
    assert str(err.value).count(".weight") == 20
    assert torch.equal(module[0].weight, torch.ones(2, 2))  # nothing loaded on error


def test_lm_shards_are_never_opened(tmp_path):
    d = write_tiny_model("qwen3_vl", tmp_path / "c", num_shards=4)
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    vision_files = {f for k, f in weight_map.items() if k.startswith("model.visual.")}
    lm_files = set(weight_map.values()) - vision_files
    assert len(lm_files) == 3
    for f in lm_files:  # garbage, not chmod: tests run as root
        (d / f).write_bytes(b"\xff" * 64)
    state, report = load_vision_weights(d, (("model.visual.", ""),), progress=False)
    assert set(report.shards_opened) == vision_files
    assert set(report.shards_skipped) == lm_files
    assert len(state) == sum(1 for k in weight_map if k.startswith("model.visual."))
    # The same corruption in a vision shard is caught: the skip above is real.
    (d / sorted(vision_files)[0]).write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="cannot read vision tensors"):
        load_vision_weights(d, (("model.visual.", ""),), progress=False)


def test_clear_errors_for_bad_checkpoints(tmp_path, ckpts):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_vision_weights(tmp_path / "nope", QWEN)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_vision_weights(empty, QWEN)
    (empty / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_vision_weights(empty, QWEN)
    with pytest.raises(CheckpointError, match="no vision tensors.*'vision_tower.'"):
        load_vision_weights(ckpts["single"], (("vision_tower.", ""),), progress=False)
    broken = write_tiny_model("qwen2_vl", tmp_path / "broken", num_shards=2)
    (broken / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00001-of-00002"):
        load_vision_weights(broken, QWEN, progress=False)


_RSS_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch, safetensors.torch
    from epd_encoder.models.loading.loader import load_vision_weights

    def hwm():
        # VmHWM belongs to this process image; ru_maxrss would start at the parent's RSS
        # (Linux carries it across fork and exec), hiding growth below a large pytest's.
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    before = hwm()
    if sys.argv[2] == "vision":
        state, _ = load_vision_weights(sys.argv[1], [("visual.", "")], dtype=torch.bfloat16, progress=False)
    else:  # the naive control: copy every tensor of the single file, as loading a full model does
        state = {k: t.clone() for k, t in safetensors.torch.load_file(sys.argv[1] + "/model.safetensors").items()}
    after = hwm()
    print((after - before) * 1024)
    """
)


def _rss_increase(d: Path, mode: str) -> int:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(d), mode],
        check=True, capture_output=True, text=True, cwd=root, timeout=120,
    )
    return int(out.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 3])
def test_peak_rss_stays_far_below_the_lm_size(tmp_path, shards):
    d = write_tiny_model("qwen2_vl", tmp_path / "big", lm_scale=18000, num_shards=shards)
    info = read_checkpoint(d)
    sizes = {}
    for file in info.weight_files:
        with safe_open(d / file, "pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                sizes[k] = torch.Size(s.get_shape()).numel() * 4
    lm = sum(v for k, v in sizes.items() if not k.startswith("visual."))
    vision = sum(v for k, v in sizes.items() if k.startswith("visual."))
    assert lm > 0.9e9 and vision < 5e6
    assert _rss_increase(d, "vision") < 0.1 * lm
    if shards == 1:  # the measurement does see a full read
        assert _rss_increase(d, "all") > 0.5 * lm


def test_progress_is_quiet_off_a_tty_and_a_summary_is_logged(ckpts, capsys, caplog):
    caplog.set_level("INFO", logger="epd_encoder.models.loading.loader")
    load_vision_weights(ckpts["sharded"], QWEN, progress=True)
    assert capsys.readouterr().err == ""  # stderr is captured, hence not a TTY
    summary = [r.getMessage() for r in caplog.records if r.name == "epd_encoder.models.loading.loader"]
    assert len(summary) == 1 and "from 1 of 4 shards" in summary[0]


def test_progress_bar_is_drawn_on_a_tty(ckpts, monkeypatch):
    import io
    import sys

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    load_vision_weights(ckpts["sharded"], QWEN, progress=True)
    assert "vision weights" in tty.getvalue() and "\r" in tty.getvalue()  # a bar, redrawn in place


def test_digest_identifies_the_vision_weights(tmp_path):
    from epd_encoder.models.registry import get_family
    from epd_encoder.models.tiny import write_tiny_model

    prefixes = get_family("qwen2_vl").weight_prefixes
    a = write_tiny_model("qwen2_vl", tmp_path / "a", seed=0)
    b = write_tiny_model("qwen2_vl", tmp_path / "b", seed=0)
    c = write_tiny_model("qwen2_vl", tmp_path / "c", seed=1)  # same shapes, other weights
    da = load_vision_weights(a, prefixes, progress=False)[1].digest
    assert da == load_vision_weights(b, prefixes, progress=False)[1].digest
    assert da != load_vision_weights(c, prefixes, progress=False)[1].digest and len(da) == 64
