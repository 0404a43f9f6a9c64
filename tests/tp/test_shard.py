# SPDX-License-Identifier: Apache-2.0
"""Weights-mode tensor parallelism: real gloo ranks, each loading only its shard, equal TP1.

One spawn of N rank processes per world size runs every family (the import of torch and
transformers dominates a rank's cost); rank 0 also loads the unsharded tower and writes
both outputs, so the parent asserts per family. N=2 runs the tiny checkpoints; they all
have 2 heads, so N=3 runs test-local widened checkpoints (6 heads, built from the tiny
configs here without changing them), which also cover uneven MLP splits and InternVL's
qk-norm.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from epd_encoder.errors import ConfigError
from epd_encoder.models.loading.checkpoint import read_checkpoint
from epd_encoder.models.registry import get_family
from epd_encoder.models.tiny import tiny_config, write_tiny_model
from epd_encoder.tp.shard import load_vision_shard, plan_for, shard_stats, shard_tower, take

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl", "kimi_k25")
TOL = 1e-5


# ----------------------------------------------------------------------------- inputs
def _batches(family: str, tower) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two packed batches per family: mixed images plus a clip with t > 1, then one image."""
    g = torch.Generator().manual_seed(7)
    if family == "internvl":  # 448-px tiles; a clip's frames are tiles
        side = tower.vision_tower.embeddings.grid[0]
        grids = [[[2, side, side], [1, side, side]], [[1, side, side]]]
        return [(torch.randn(sum(t for t, _, _ in gr), 3, 448, 448, generator=g), torch.tensor(gr)) for gr in grids]
    if family == "kimi_k25":
        p = tower.vision_tower.patch_embed.patch
        grids = [[[1, 8, 8], [1, 4, 6], [3, 4, 4]], [[1, 6, 10]]]
        return [(torch.randn(sum(t * h * w for t, h, w in gr), 3, p, p, generator=g), torch.tensor(gr))
                for gr in grids]
    width = tower.patch_embed.proj.weight[0].numel()
    # 12x16 patches = 6x8 merge units: Qwen2.5-VL's 4x4-unit windows are partly short.
    grids = [[[1, 12, 16], [2, 8, 8], [1, 4, 4]], [[3, 8, 12]]]
    return [(torch.randn(sum(t * h * w for t, h, w in gr), width, generator=g), torch.tensor(gr)) for gr in grids]


def _widen(family: str):
    """The tiny config with 6 heads (head_dim 8) and widths divisible by 3 (Qwen2.5-VL's MLP not)."""
    config = tiny_config(family)
    vc = config.vision_config
    if family == "qwen2_vl":
        vc.embed_dim, vc.num_heads = 48, 6
    elif family == "internvl":
        vc.hidden_size, vc.num_attention_heads, vc.intermediate_size, vc.use_qk_norm = 48, 6, 96, True
    elif family == "kimi_k25":
        vc.hidden_size, vc.num_attention_heads, vc.intermediate_size = 48, 6, 96
        config.projection_hidden_size = 48
    else:
        vc.hidden_size, vc.num_heads = 48, 6
        vc.intermediate_size = 100 if family == "qwen2_5_vl" else 96  # 100 = 33 + 33 + 34 at N=3
    return config


def write_wide_model(family: str, out: Path) -> Path:
    """A random checkpoint of the widened tower, saved under the checkpoint's vision names."""
    from safetensors.torch import save_file

    config = _widen(family)
    fam = get_family(config.model_type)
    torch.manual_seed(3)
    tower = fam.build_tower(config)
    prefix = {"qwen2_vl": "visual.", "qwen2_5_vl": "visual.", "qwen3_vl": "model.visual."}.get(family, "")
    state = {}
    for name, p in tower.state_dict().items():
        # Linear/conv weights keep their default init (the tiny checkpoints' scale); norms, layer
        # scales, biases and the zero-initialized grids and tokens get noise, so every one matters.
        if p.dim() == 1 or not p.any():
            p = p + torch.randn(p.shape) * 0.1
        state[prefix + name] = p.contiguous()
    out.mkdir(parents=True)
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ----------------------------------------------------------------------------- ranks
class _Counted:
    """Counts what the loader copies out of safetensors files: sliced bytes and whole-tensor reads."""

    sliced = 0
    whole_reads: list[str] = []

    def __init__(self, real_open):
        self.real_open = real_open

    def __call__(self, *args, **kwargs):
        counter = self

        class Handle:
            def __init__(self, f):
                self.f = f

            def get_tensor(self, name):
                counter.whole_reads.append(name)
                return self.f.get_tensor(name)

            def get_slice(self, name):
                sl = self.f.get_slice(name)

                class Slice:
                    get_shape = sl.get_shape

                    def __getitem__(self, idx):
                        t = sl[idx]
                        _Counted.sliced += t.numel() * t.element_size()
                        return t

                return Slice()

            def __getattr__(self, name):
                return getattr(self.f, name)

        class Ctx:
            def __enter__(self):
                self.cm = counter.real_open(*args, **kwargs)
                return Handle(self.cm.__enter__())

            def __exit__(self, *exc):
                return self.cm.__exit__(*exc)

        return Ctx()


def _rank_main(rank: int, world: int, port: int, cases: list[tuple[str, str]], out_dir: str) -> None:
    import torch.distributed as dist

    from epd_encoder.models.registry import load_vision_model

    import safetensors

    torch.set_num_threads(1)
    safetensors.safe_open = _Counted(safetensors.safe_open)  # the loader imports it at call time
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for family, ckpt in cases:
            _Counted.sliced, _Counted.whole_reads = 0, []
            model, report = load_vision_shard(ckpt, rank, world, dtype=torch.float32, progress=False)
            counted = {"sliced": _Counted.sliced, "whole_reads": list(_Counted.whole_reads)}
            params = sum(p.numel() for p in model.tower.parameters())
            with torch.inference_mode():  # as the executor runs it
                outs = [model.tower.forward_packed(px, grid) for px, grid in _batches(family, model.tower)]
            result = {"bytes": report.bytes, "counted": counted, "params": params, "digest": model.weights_digest,
                      "outs": outs}
            if rank == 0:
                ref = load_vision_model(ckpt, dtype=torch.float32, progress=False)
                with torch.inference_mode():
                    result["ref"] = [ref.tower.forward_packed(px, grid) for px, grid in _batches(family, ref.tower)]
                result["ref_params"] = sum(p.numel() for p in ref.tower.parameters())
            torch.save(result, Path(out_dir) / f"{family}-r{rank}.pt")
        # Leave together: a rank tearing gloo down while a peer still computes (rank 0's
        # reference) could abort in gloo's thread teardown ("terminate called without an
        # active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, cases: list[tuple[str, Path]], out: Path) -> Path:
    import torch.multiprocessing as mp

    out.mkdir()
    mp.spawn(_rank_main, args=(world, _free_port(), [(f, str(c)) for f, c in cases], str(out)),
             nprocs=world, join=True)
    return out


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    # Qwen2.5-VL as a sharded checkpoint (index + vision and LM shards): slices come from the index's files
    return {f: write_tiny_model(f, root / f, num_shards=3 if f == "qwen2_5_vl" else 1) for f in FAMILIES}


@pytest.fixture(scope="module")
def tp2(tiny_ckpts, tmp_path_factory):
    return _spawn(2, list(tiny_ckpts.items()), tmp_path_factory.mktemp("tp2") / "out")


@pytest.fixture(scope="module")
def wide_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    return {f: write_wide_model(f, root / f) for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl", "kimi_k25")}


@pytest.fixture(scope="module")
def tp3(wide_ckpts, tmp_path_factory):
    return _spawn(3, list(wide_ckpts.items()), tmp_path_factory.mktemp("tp3") / "out")


# ----------------------------------------------------------------------------- checks
def _expected_bytes(ckpt: Path, rank: int, world: int) -> tuple[int, int, int]:
    """(bytes rank ``rank`` must read, of the whole vision part, of its replicated tensors), from
    the headers only."""
    from safetensors import safe_open

    from epd_encoder.models.loading.loader import _rename

    info = read_checkpoint(ckpt)
    fam = get_family(info.model_type)
    plan = plan_for(fam.name, rank, world)
    mine = whole = replicated = 0
    for name, file in info.weight_map.items():
        target = _rename(name, fam.weight_prefixes)
        if target is None:
            continue
        with safe_open(ckpt / file, "pt") as f:
            sl = f.get_slice(name)
            shape = tuple(sl.get_shape())
            size = torch.empty((), dtype=getattr(torch, {"F32": "float32"}[sl.get_dtype()])).element_size()
            whole += torch.Size(shape).numel() * size
            part = take(torch.empty(shape, device="meta"), shape, plan.kind(target), rank, world)
            mine += part.numel() * size
            replicated += 0 if plan.kind(target) else part.numel() * size
    return mine, whole, replicated


def _check(out_dir: Path, family: str, ckpt: Path, world: int) -> dict:
    ranks = [torch.load(out_dir / f"{family}-r{r}.pt") for r in range(world)]
    r0 = ranks[0]
    diffs = []
    for (out, deep), (ref_out, ref_deep) in zip(r0["outs"], r0["ref"]):
        assert out.shape == ref_out.shape
        diffs.append((out - ref_out).abs().max().item())
        assert (deep is None) == (ref_deep is None)
        for d, rd in zip(deep or [], ref_deep or []):
            assert d.shape == rd.shape
            diffs.append((d - rd).abs().max().item())
    scale = max(o.abs().max().item() for o, _ in r0["ref"])
    assert max(diffs) <= TOL, f"{family} tp{world}: max |TP - TP1| = {max(diffs):.3g} (max |TP1| {scale:.3g})"
    split_read = 0
    for r, res in enumerate(ranks):
        mine, whole, replicated = _expected_bytes(ckpt, r, world)
        assert res["bytes"] == mine, f"rank {r} read {res['bytes']} bytes, its shard is {mine}"
        # counted at safe_open itself: only slices were copied out, never a whole tensor
        assert res["counted"] == {"sliced": mine, "whole_reads": []}
        split_read += mine - replicated
        # balanced blocks: a rank's part of the split tensors is 1/N, give or take a column per tensor
        assert abs((mine - replicated) * world - (whole - replicated)) <= 0.02 * (whole - replicated)
        # every rank's output after the all-reduces is the same tower output
        for (o, _), (o0, _) in zip(res["outs"], r0["outs"]):
            assert (o - o0).abs().max().item() <= TOL
    assert split_read == whole - replicated, "the ranks' slices do not add up to the split tensors"
    assert len({res["digest"] for res in ranks}) == 1, "ranks disagree on the whole-tower digest"
    assert sum(res["params"] for res in ranks) < world * r0["ref_params"]
    return {"max_diff": max(diffs), "fraction": r0["params"] / r0["ref_params"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_tp1_and_reads_only_its_shard(family, tp2, tiny_ckpts):
    print(family, "tp2", _check(tp2, family, tiny_ckpts[family], 2))


@pytest.mark.parametrize("family", ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl", "kimi_k25"))
def test_tp3_widened_equals_tp1(family, tp3, wide_ckpts):
    print(family, "tp3", _check(tp3, family, wide_ckpts[family], 3))


# ----------------------------------------------------------------------------- in process
@pytest.mark.parametrize("family", FAMILIES)
def test_heads_not_divisible_is_a_config_error_before_any_read(family, tiny_ckpts, monkeypatch):
    import epd_encoder.models.loading.loader as loader

    def no_read(*a, **k):
        raise AssertionError("weights were read before the divisibility check")

    monkeypatch.setattr(loader, "load_vision_weights", no_read)
    with pytest.raises(ConfigError) as e:
        load_vision_shard(tiny_ckpts[family], 0, 3, progress=False)
    fam = get_family(read_checkpoint(tiny_ckpts[family]).model_type).name
    assert fam in str(e.value) and "2 attention heads" in str(e.value) and "size 3" in str(e.value)


def test_shard_tower_leaves_the_tower_untouched_on_error(tiny_ckpts):
    from epd_encoder.models.registry import load_vision_model

    model = load_vision_model(tiny_ckpts["qwen2_5_vl"], dtype=torch.float32, progress=False)
    before = {k: v.clone() for k, v in model.tower.state_dict().items()}
    with pytest.raises(ConfigError):
        shard_tower("qwen2_5_vl", model.tower, 1, 3)
    after = model.tower.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert type(model.tower.blocks[0]).__name__ == "VisionBlock"


@pytest.mark.parametrize("family", FAMILIES)
def test_ranks_partition_the_split_weights(family, tiny_ckpts):
    """Shards of a loaded tower, over the ranks, hold every split weight exactly once."""
    from epd_encoder.models.registry import load_vision_model

    model = load_vision_model(tiny_ckpts[family], dtype=torch.float32, progress=False)
    full = {k: v.clone() for k, v in model.tower.state_dict().items()}
    stats = shard_stats(family, model.tower, 2)
    parts = []
    for r in range(2):
        tower = load_vision_model(tiny_ckpts[family], dtype=torch.float32, progress=False).tower
        shard_tower(family, tower, r, 2)
        parts.append(tower.state_dict())
        assert sum(p.numel() for p in tower.parameters()) == stats.per_rank[r]
    plan = plan_for(family, 0, 2)
    for name, whole in full.items():
        kind = plan.kind(name)
        if kind is None:
            assert all(torch.equal(p[name], whole) for p in parts)
        elif kind == "row":
            assert torch.equal(torch.cat([p[name] for p in parts], dim=1), whole)
        elif kind == "col":
            assert torch.equal(torch.cat([p[name] for p in parts]), whole)
        else:  # qkv: each rank's thirds are its heads of q, k and v
            pieces = [p[name].chunk(3) for p in parts]
            assert torch.equal(torch.cat([torch.cat([pc[i] for pc in pieces]) for i in range(3)]), whole)
    # replicated parameters count on every rank, split ones once over the ranks
    assert sum(stats.per_rank) == stats.total + stats.replicated
    assert 0.5 < stats.block_fraction < 0.52  # only the blocks' norms and output biases are whole
    json.dumps(stats.__dict__)  # plain numbers (docs quote them)


def test_world_one_is_the_unsharded_load(tiny_ckpts):
    """``--tp 1`` through the shard loader: the same tensors, digest and output, bitwise."""
    from epd_encoder.models.registry import load_vision_model

    ckpt = tiny_ckpts["qwen3_vl"]
    shard, report = load_vision_shard(ckpt, 0, 1, dtype=torch.float32, progress=False)
    whole = load_vision_model(ckpt, dtype=torch.float32, progress=False)
    assert shard.weights_digest == whole.weights_digest
    assert report.bytes == _expected_bytes(ckpt, 0, 1)[1]
    px, grid = _batches("qwen3_vl", whole.tower)[0]
    with torch.inference_mode():
        (a, da), (b, db) = shard.tower.forward_packed(px, grid), whole.tower.forward_packed(px, grid)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(da, db))


def test_rank_out_of_range_is_a_config_error(tiny_ckpts):
    with pytest.raises(ConfigError, match="rank 2 of world 2"):
        load_vision_shard(tiny_ckpts["qwen2_vl"], 2, 2, progress=False)
