# SPDX-License-Identifier: Apache-2.0
"""Tensor/data-parallel encode on GPUs, one rank per GPU: equality with TP1, then images/s.

Equality: ``--tp 2`` in weights and data mode against TP1 (``ExecutorSpec.build``) on the tiny
Qwen2.5-VL and Qwen3-VL (deepstack) checkpoints, max|TPn - TP1| / max|TP1| over every output:
<= 1e-5 in fp32 (the CPU smoke), <= 2e-2 in bf16 (weights mode sums partial products in another
order; data mode runs each item with other batch mates).
Speed: images/s for TP1, TP2 weights and TP2 data on a Qwen2.5-VL-7B-sized tower (random bf16
weights written to a temporary checkpoint: each rank loads its own replica or shard) at 1024²
(after smart_resize), pixels finished on rank 0's device as the server does. Ratios against TP1.
With fewer than 2 GPUs only TP1 runs and the TP2 rows say so.
Failure: rank 1 of a weights-mode group is SIGKILLed inside its forward, between two of the
tower's all-reduces (on NCCL under CUDA). The survivor must raise ``RankFailed`` in the encoding
thread within the collective timeout (``tp/group.py`` ``backend_environment``: blocking wait, no
process teardown), its watchdog must see the death within seconds, and ``close()`` must return;
it runs in a child process, so a survivor torch aborts (SIGABRT) or that hangs is a FAIL row.

Run: python benchmarks/tp_gpu_check.py [--batch 8]
     python benchmarks/tp_gpu_check.py --device cpu --quick   # smoke: gloo, 2 CPU ranks, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import QWEN25_7B, QWEN25_QUICK, Row, image, print_table, rel_err, sync  # noqa: E402

from epd_encoder.tp import layers  # noqa: E402
from epd_encoder.tp.data import ExecutorSpec, TPExecutor  # noqa: E402
from epd_encoder.tp.weights import TPWeightsExecutor, WeightsRank  # noqa: E402

HERE = Path(__file__).resolve().parent

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
MODES = {"weights": TPWeightsExecutor, "data": TPExecutor}
BACKENDS: set[str] = set()  # what the rank groups ran their collectives on (tp/group.py decides)


def run_group(cls, spec: ExecutorSpec, world: int, timeout: float, fn):
    """``fn(executor)`` on a started rank group, closed after (``start`` spawns ranks 1..N-1)."""
    ex = cls(spec, world, timeout_s=timeout).start()
    try:
        BACKENDS.add(str(torch.distributed.get_backend()))
        return fn(ex)
    finally:
        ex.close()


def write_checkpoint(out: Path, vision: dict, device: torch.device) -> Path:
    """The tiny Qwen2.5-VL checkpoint's files with ``vision`` as its vision config and random
    bf16 vision tensors only (the loaders never read the LM)."""
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLConfig

    from epd_encoder.models.registry import get_family
    from epd_encoder.models.tiny import default_model_dir

    tiny = default_model_dir("qwen2_5_vl")
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    config = json.loads((tiny / "config.json").read_text())
    config["vision_config"] = {**config["vision_config"], **vision}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    torch.manual_seed(0)
    with torch.device(device):
        tower = get_family("qwen2_5_vl").build_tower(Qwen2_5_VLConfig(vision_config=vision))
    save_file({f"model.visual.{k}": v.to(torch.bfloat16).cpu().contiguous() for k, v in tower.state_dict().items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    del tower
    return out


def items_for(path: Path, sizes, device: torch.device | None):
    from epd_encoder.preprocess.registry import load_preprocessor

    pre = load_preprocessor(path)
    return [pre.finish(pre.stage(image(i, w, h)), device) for i, (w, h) in enumerate(sizes)]


def equality_rows(family: str, spec_args: dict, world: int, timeout: float) -> list[Row]:
    from epd_encoder.models.tiny import default_model_dir

    path = default_model_dir(family)
    spec = ExecutorSpec(checkpoint=str(path), **spec_args)
    items = items_for(path, [(224, 168), (112, 140), (448, 448), (336, 336)], None)
    want = spec.build(0).encode(items)
    rows = []
    for mode, cls in MODES.items():
        got = run_group(cls, spec, world, timeout, lambda ex: ex.encode(items))
        err = max(rel_err(g, w) for g, w in zip(got, want))
        tol = TOL[spec.dtype]
        rows.append(Row("equal", f"{family} --tp {world} {mode} vs tp1, {spec.device} {spec.dtype}", f"{err:.1e}",
                        f"<= {tol:.0e}", "PASS" if err <= tol else "FAIL"))
    return rows


def timed(encode, items, reps: int, device: torch.device) -> float:
    """Images/s: one warm batch, then the median of ``reps`` timed batches."""
    encode(items)
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        encode(items)
        sync(device)
        times.append(time.perf_counter() - t0)
    return len(items) / statistics.median(times)


def speed_rows(path: Path, name: str, spec_args: dict, world: int, size: int, batch: int, reps: int,
               timeout: float) -> list[Row]:
    spec = ExecutorSpec(checkpoint=str(path), **spec_args)
    tp1 = spec.build(0)
    items = items_for(path, [(size, size)] * batch, tp1.device if tp1.device.type == "cuda" else None)
    grid = items[0].grid_thw
    base = timed(tp1.encode, items, reps, tp1.device)
    label = f"{name} {spec.dtype}, {size}² grid {tuple(grid)}, batch {batch}"
    rows = [Row("speed", f"tp1 {label}", f"{base:.2f} img/s", "-", "INFO")]
    del tp1
    for mode, cls in MODES.items():
        if world < 2:
            rows.append(Row("speed", f"tp2 {mode}", "not run: TP2 needs 2 GPUs", "-", "INFO"))
            continue
        ips = run_group(cls, spec, world, timeout, lambda ex: timed(ex.encode, items, reps, ex.device))
        rows.append(Row("speed", f"tp{world} {mode} {label}", f"{ips:.2f} img/s ({ips / base:.2f}x tp1)", "-",
                        "INFO"))
    return rows


# -- a rank that dies mid-forward ------------------------------------------------------------
def make_stalling_rank(rank: int, size: int, marker: str, **spec):
    """Rank 1 (built in its process by name): from batch 2 on, it stops before its second
    all-reduce, writes its pid to ``marker`` and waits to be killed; rank 0 is then inside it."""
    handler = WeightsRank(rank, size, ExecutorSpec(**spec))
    real_run, real_reduce, state = handler.run, layers.all_reduce_, {"seq": 0, "calls": 0}

    def run(work):
        state["seq"], state["calls"] = work.seq, 0
        return real_run(work)

    def all_reduce_(t, group):
        state["calls"] += 1
        if state["seq"] >= 2 and state["calls"] == 2:
            Path(marker).write_text(str(os.getpid()))
            threading.Event().wait()
        return real_reduce(t, group)

    handler.run, layers.all_reduce_ = run, all_reduce_  # RowParallelLinear looks it up at call time
    return handler


def dead_rank_child(device: torch.device, timeout: float) -> int:
    """In a child process: one good batch, then rank 1 killed inside the second; one JSON line."""
    from epd_encoder.models.tiny import default_model_dir

    path = default_model_dir("qwen2_5_vl")
    spec = ExecutorSpec(checkpoint=str(path), dtype="float32", device=device.type)
    seen: dict[str, float] = {}
    ex = TPWeightsExecutor(spec, 2, timeout_s=timeout, heartbeat_s=1.0,
                           on_failure=lambda e: seen.setdefault("failed", time.monotonic()))
    box: dict = {}
    with tempfile.TemporaryDirectory(prefix="tp-dead-rank-") as tmp:
        marker = Path(tmp) / "stalled"
        ex.group._factory = "tp_gpu_check:make_stalling_rank"
        ex.group._args.update(marker=str(marker))
        ex.start()
        items = items_for(path, [(224, 168)], device if device.type == "cuda" else None)
        ex.encode(items)
        sync(device)

        def second() -> None:
            try:
                ex.encode(items)
                sync(device)  # a collective left hanging on the GPU stream shows here
                box["outcome"] = "returned"
            except BaseException as e:
                box["outcome"], box["message"] = type(e).__name__, str(e)[:160]
            box["at"] = time.monotonic()

        worker = threading.Thread(target=second, daemon=True)
        worker.start()
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        killed = time.monotonic()
        os.kill(int(marker.read_text()), signal.SIGKILL)
        worker.join(timeout + 30)
        t0 = time.monotonic()
        ex.close()
        closed_s = time.monotonic() - t0
    print(json.dumps({"outcome": box.get("outcome", "hung"), "message": box.get("message", ""),
                      "raised_s": box["at"] - killed if "at" in box else math.inf,
                      "seen_s": seen.get("failed", math.inf) - killed, "closed_s": closed_s,
                      "backend": ex.group.backend}))
    return 0


def dead_rank_rows(device: torch.device, timeout: float) -> list[Row]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    what = f"rank 1 SIGKILLed mid-forward, {device.type}"
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dead-rank-child", "--device",
                               device.type, "--fail-timeout", str(timeout)], env=env, capture_output=True,
                              text=True, timeout=timeout + 180)
    except subprocess.TimeoutExpired:
        return [Row("fail", what, "the survivor hung", "RankFailed", "FAIL")]
    if proc.returncode != 0:
        how = signal.Signals(-proc.returncode).name if proc.returncode < 0 else f"status {proc.returncode}"
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:100]
        return [Row("fail", what, f"the survivor ended by {how}: {tail}", "RankFailed", "FAIL")]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = timeout + 10
    ok = r["outcome"] == "RankFailed" and r["raised_s"] <= bound
    return [
        Row("fail", f"{what} ({r['backend']}): the encode raises", f"{r['outcome']} after {r['raised_s']:.1f} s",
            f"RankFailed <= {bound:g} s", "PASS" if ok else "FAIL"),
        Row("fail", "on_failure fires (the server answers 503)", f"{r['seen_s']:.1f} s", "<= 5 s",
            "PASS" if r["seen_s"] <= 5 else "FAIL"),
        Row("fail", "close() after the failure", f"{r['closed_s']:.1f} s", "<= 15 s",
            "PASS" if r["closed_s"] <= 15 else "FAIL"),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default: NCCL-sized run, one rank per GPU) or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny speed tower at 224², batch 2")
    ap.add_argument("--dtype", default=None, help="bfloat16 (cuda default) or float32 (cpu default)")
    ap.add_argument("--batch", type=int, default=None, help="images per speed batch (default 8; quick 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed batches (default 5; quick 2)")
    ap.add_argument("--timeout", type=float, default=120.0, help="collective timeout of the rank groups, s")
    ap.add_argument("--fail-timeout", type=float, default=20.0, help="collective timeout of the dead-rank check, s")
    ap.add_argument("--dead-rank-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: run with --device cpu --quick for the smoke mode", file=sys.stderr)
        return 2
    if args.dead_rank_child:
        return dead_rank_child(device, args.fail_timeout)
    world = min(2, torch.cuda.device_count()) if device.type == "cuda" else 2
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    size, batch, reps = (224, args.batch or 2, args.reps or 2) if args.quick else (1024, args.batch or 8, args.reps or 5)
    spec_args = dict(dtype=dtype, device=device.type)
    start = time.perf_counter()
    print(f"tp_gpu_check: {device.type}, {world} rank(s), {dtype}, torch {torch.__version__}"
          + (f", {torch.cuda.device_count()} GPU(s)" if device.type == "cuda" else "")
          + (", QUICK (tiny sizes)" if args.quick else ""))
    rows: list[Row] = []
    if world < 2:
        rows.append(Row("equal", "--tp 2 vs tp1", "not run: TP2 needs 2 GPUs", "-", "INFO"))
    else:
        for family in ("qwen2_5_vl", "qwen3_vl"):
            try:
                rows += equality_rows(family, spec_args, world, args.timeout)
            except Exception as e:  # a failed group is a FAIL row; the speed rows still run
                rows.append(Row("equal", family, f"{type(e).__name__}: {str(e)[:120]}", "-", "FAIL"))
    if world < 2:
        rows.append(Row("fail", "rank 1 SIGKILLed mid-forward", "not run: TP2 needs 2 GPUs", "-", "INFO"))
    else:
        rows += dead_rank_rows(device, args.fail_timeout)
    with tempfile.TemporaryDirectory(prefix="tp-gpu-check-") as tmp:
        try:
            path = write_checkpoint(Path(tmp) / "ckpt", QWEN25_QUICK if args.quick else QWEN25_7B, device)
            name = "tiny tower" if args.quick else "7B-sized tower"
            rows += speed_rows(path, name, spec_args, world, size, batch, reps, args.timeout)
        except Exception as e:
            rows.append(Row("speed", "7B-sized tower", f"{type(e).__name__}: {str(e)[:120]}", "-", "FAIL"))
    print_table(rows)
    if BACKENDS:
        print(f"collective backend: {', '.join(sorted(BACKENDS))}"
              + (" (no NCCL: tp/group.py backend_for chooses)" if device.type == "cuda"
                 and not all("nccl" in b for b in BACKENDS) else ""))
    print(f"{sum(r.status == 'FAIL' for r in rows)} FAIL of {len(rows)} rows in {time.perf_counter() - start:.0f} s")
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
