# SPDX-License-Identifier: Apache-2.0
"""One GPU check in under 5 minutes on one GPU: correctness, speed and the upload pipeline, one table.

Correctness (tolerances are max|got - want| / max|want| over every output tensor of every item):
  * every tiny family (make-tiny-model checkpoints): our tower on the device in fp32 (TF32 off)
    within 1e-4 and in bf16 within 5e-2 of our tower on the CPU in fp32; on the CPU, transformers'
    own module (``--tower reference``) within 1e-5 of ours;
  * the device L1 cache tier over the host L2 tier: put on the device, demote to the host, hit back
    onto the device, bytes equal;
  * push delivery of device-resident outputs over shm and tcp, received bytes equal.
Speed (bf16, random weights, through the serving executor: staged uint8 in, finish on the device,
one packed forward): images/s at 1024² (after smart_resize) for a Qwen2.5-VL-7B-sized and a
Qwen3-VL-8B-sized tower, as a fraction of the FLOP bound (FLOPs from the config, printed; peak from
the GPU name or --peak-tflops; target >= 50%), time to first embedding at batch 1, and host-to-device
bytes per image from the profiler's memcpy records (target: the uint8 staged bytes, not fp32).
Pipeline: a torch.profiler summary of how much host-to-device copy time runs beside kernels of
another stream, for VisionExecutor (side copy stream) and for the serving executor's finish.

Run: python benchmarks/gpu_check.py [--peak-tflops 989] [--batch 8]
     python benchmarks/gpu_check.py --device cpu --quick   # smoke: every path, tiny sizes;
                                                            # its speed numbers mean nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from epd_encoder.models.executor import VisionExecutor
from epd_encoder.types import ItemOutput

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl", "kimi_k25")
TOL = {"reference": 1e-5, "float32": 1e-4, "bfloat16": 5e-2}
TARGET_FRACTION = 0.5
# Dense bf16 tensor-core peaks (TFLOP/s, SXM parts); anything else needs --peak-tflops.
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0}

QWEN25_7B = dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=3584,
                 patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
QWEN3_8B = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=4096,
                patch_size=16, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
QWEN25_QUICK = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=64,
                    patch_size=14, window_size=112, fullatt_block_indexes=[1])
QWEN3_QUICK = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=64,
                   patch_size=16, num_position_embeddings=256, deepstack_visual_indexes=[0])


@dataclass
class Row:
    section: str
    check: str
    result: str
    target: str
    status: str  # PASS, FAIL or INFO (measured, no pass/fail on this device)


def rel_err(got: ItemOutput, want: ItemOutput) -> float:
    pairs = [(got.embedding, want.embedding), *zip(got.deepstack or (), want.deepstack or ())]
    if len(pairs) != 1 + len(want.deepstack or ()):
        return math.inf
    return max(((g.float().cpu() - w.float()).abs().max() / w.abs().max().clamp_min(1e-12)).item() for g, w in pairs)


def image(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- correctness ---------------------------------------------------------------------------
def check_family(family: str, device: torch.device) -> list[Row]:
    from epd_encoder.models.registry import load_vision_model
    from epd_encoder.models.tiny import default_model_dir
    from epd_encoder.preprocess.registry import load_preprocessor

    path = default_model_dir(family)
    pre = load_preprocessor(path)
    items = [pre.preprocess(image(i, w, h)) for i, (w, h) in enumerate([(224, 168), (112, 140), (448, 448)])]
    ref = load_vision_model(path, dtype="float32", device="cpu", progress=False)
    want = VisionExecutor(ref.tower).encode(items)
    rows = []
    theirs = load_vision_model(path, dtype="float32", device="cpu", progress=False, tower="reference")
    err = max(rel_err(g, w) for g, w in zip(VisionExecutor(theirs.tower).encode(items), want))
    rows.append(Row("correct", f"{family} transformers vs ours, cpu fp32", f"{err:.1e}", f"<= {TOL['reference']:.0e}",
                    "PASS" if err <= TOL["reference"] else "FAIL"))
    for dtype in ("float32", "bfloat16"):
        model = load_vision_model(path, dtype=dtype, device=device, progress=False)
        got = VisionExecutor(model.tower, device=device, dtype=model.dtype).encode(items)
        on_device = all(o.embedding.device.type == device.type for o in got)
        err = max(rel_err(g, w) for g, w in zip(got, want))
        ok = on_device and err <= TOL[dtype]
        rows.append(Row("correct", f"{family} {device.type} {dtype} vs cpu fp32", f"{err:.1e}",
                        f"<= {TOL[dtype]:.0e}", "PASS" if ok else "FAIL"))
    return rows


def device_outputs(device: torch.device) -> list[ItemOutput]:
    """Two bf16 qwen3_vl outputs (embedding + deepstack) resident on ``device``."""
    from epd_encoder.models.registry import load_vision_model
    from epd_encoder.models.tiny import default_model_dir
    from epd_encoder.preprocess.registry import load_preprocessor

    path = default_model_dir("qwen3_vl")
    pre = load_preprocessor(path)
    model = load_vision_model(path, dtype="bfloat16", device=device, progress=False)
    ex = VisionExecutor(model.tower, device=device, dtype=model.dtype)
    return ex.encode([pre.preprocess(image(7, 224, 224)), pre.preprocess(image(8, 336, 168))])


def check_tiered_cache(outs: list[ItemOutput], device: torch.device) -> list[Row]:
    from epd_encoder.cache.tiered import TieredEmbeddingCache

    a, b = outs
    host_a = a.map(lambda t: t.cpu())
    cache = TieredEmbeddingCache(max(a.nbytes, b.nbytes), 1 << 30,
                                 to_host=lambda v: v.map(lambda t: t.to("cpu")),
                                 to_device=lambda v: v.map(lambda t: t.to(device)))
    cache.put("a", a, a.nbytes)
    cache.put("b", b, b.nbytes)  # L1 holds one: "a" is demoted to the host
    demoted = cache.tier_of("a") == 2 and cache.stats.demotions == 1
    back = cache.get("a")
    promoted = cache.tier_of("a") == 1 and back is not None and back.embedding.device.type == device.type
    same = back is not None and all(torch.equal(x.cpu(), y) for x, y in zip(
        [back.embedding, *(back.deepstack or ())], [host_a.embedding, *(host_a.deepstack or ())]))
    return [Row("cache", f"L1 {device.type} -> L2 host demotion", f"tier {cache.tier_of('b')}/{2 if demoted else '?'}",
                "b in L1, a in L2", "PASS" if demoted else "FAIL"),
            Row("cache", "L2 hit promoted back to the device", f"bytes equal: {same}", "bitwise",
                "PASS" if promoted and same else "FAIL")]


def push_row(outs: list[ItemOutput], backend: str) -> Row:
    from epd_encoder.receiver import EmbeddingReceiver
    from epd_encoder.transfer.messages import WireItem
    from epd_encoder.transfer.sender import PushSender
    from epd_encoder.wire import dtype_name

    items = [WireItem(key=f"{i:064x}", num_tokens=o.embedding.shape[0], grid_thw=(1, 2, 2 * o.embedding.shape[0]),
                      hidden_size=o.embedding.shape[1], dtype=dtype_name(o.embedding.dtype),
                      num_deepstack=len(o.deepstack or ())) for i, o in enumerate(outs)]
    nbytes = sum(o.nbytes for o in outs)
    done: list[dict] = []
    with EmbeddingReceiver(backend, pool_bytes=4 * nbytes + (1 << 20)) as rx:
        tx = PushSender(sender_id=f"gpu-check-{backend}", bootstrap_timeout=30.0, transfer_timeout=30.0)
        try:
            t0 = time.perf_counter()
            handle = tx.open(rx.delivery("room", items=items), "req", items, on_done=done.append)
            handle.deliver(outs, lambda: None)
            got = rx.wait("room", timeout=30)
            ms = (time.perf_counter() - t0) * 1e3
        finally:
            tx.close(timeout=5.0)
    same = len(got) == len(outs) and all(
        torch.equal(g.embedding, o.embedding.cpu())
        and all(torch.equal(x, y.cpu()) for x, y in zip(g.deepstack or (), o.deepstack or ()))
        for g, o in zip(got, outs))
    src = outs[0].embedding.device.type
    return Row("push", f"{backend} from {src} memory, {nbytes} B", f"equal: {same}, {ms:.0f} ms", "bitwise",
               "PASS" if same else "FAIL")


# -- speed ---------------------------------------------------------------------------------
def tower_flops(v: dict, grid: tuple[int, int, int], *, gated: bool, window: bool) -> float:
    """2 x multiply-adds: patch embed, per layer qkv/proj/MLP and attention scores+values
    (window layers see one window), the merger and each deepstack merger (2x2 merge)."""
    t, h, w = grid
    n, d, inter, p = t * h * w, v["hidden_size"], v["intermediate_size"], v["patch_size"]
    total = 2.0 * n * (3 * 2 * p * p) * d
    win = (v["window_size"] // p) ** 2 if window else 0
    for i in range(v["depth"]):
        total += 2.0 * n * (4 * d * d + (3 if gated else 2) * d * inter)
        seg = h * w if not window or i in v["fullatt_block_indexes"] else min(win, h * w)
        total += 4.0 * n * seg * d
    mergers = 1 + len(v.get("deepstack_visual_indexes", ()))
    return total + mergers * 2.0 * (n // 4) * (16 * d * d + 4 * d * v["out_hidden_size"])


@dataclass(frozen=True)
class TowerCase:
    name: str
    family: str  # model_type
    vision: dict
    pre: dict  # preprocessor_config.json fields
    gated: bool
    window: bool


def cases(quick: bool) -> list[TowerCase]:
    q25 = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56, max_pixels=12845056)
    q3 = dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=65536, max_pixels=16777216,
              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    if quick:
        return [TowerCase("qwen2.5-vl tiny", "qwen2_5_vl", QWEN25_QUICK, q25, True, True),
                TowerCase("qwen3-vl tiny", "qwen3_vl", QWEN3_QUICK, q3, False, False)]
    return [TowerCase("qwen2.5-vl-7B tower", "qwen2_5_vl", QWEN25_7B, q25, True, True),
            TowerCase("qwen3-vl-8B tower", "qwen3_vl", QWEN3_8B, q3, False, False)]


def build_serving(case: TowerCase, device: torch.device):
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    from epd_encoder.api.metrics import Metrics
    from epd_encoder.models.registry import get_family
    from epd_encoder.preprocess.qwen import QwenPreprocessor
    from epd_encoder.server.executor import ServingExecutor

    cfg = (Qwen2_5_VLConfig if case.family == "qwen2_5_vl" else Qwen3VLConfig)(vision_config=case.vision)
    torch.manual_seed(0)
    with torch.device(device):
        tower = get_family(case.family).build_tower(cfg)
    ex = VisionExecutor(tower, device=device, dtype=torch.bfloat16)
    pre = QwenPreprocessor.from_config(case.pre)
    return ex, pre, ServingExecutor(ex, pre, Metrics(), max_batch_cost=1 << 40)


def sources(staged):
    from epd_encoder.server.executor import PixelSource

    return [PixelSource(staged=s, stage=lambda s=s: s, cost=s.pixels.shape[0]) for s in staged]


def encode_ok(serving, payloads, device: torch.device) -> list[ItemOutput]:
    outs = serving.encode(payloads)
    sync(device)
    bad = [o for o in outs if isinstance(o, BaseException)]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outs)} items failed: {bad[0]!r}")
    return outs


def trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]


def copy_overlap(events: list[dict]) -> tuple[int, int, float, float]:
    """(HtoD copies, their bytes, copy µs, µs of copy concurrent with a kernel of another stream)."""
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    busy = 0.0
    for c in copies:
        c0, c1, stream = c["ts"], c["ts"] + c["dur"], c.get("args", {}).get("stream")
        spans = sorted((max(c0, k["ts"]), min(c1, k["ts"] + k["dur"])) for k in kernels
                       if k.get("args", {}).get("stream") != stream and k["ts"] < c1 and k["ts"] + k["dur"] > c0)
        end = c0
        for a, b in spans:  # union of the overlapping kernel spans
            a = max(a, end)
            if b > a:
                busy, end = busy + b - a, b
    nbytes = sum(int(c.get("args", {}).get("bytes", 0)) for c in copies)
    return len(copies), nbytes, sum(c["dur"] for c in copies), busy


def profile(fn, device: torch.device) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        fn()
        sync(device)
    return trace_events(prof)


def speed_rows(case: TowerCase, device: torch.device, size: int, batch: int, reps: int,
               peak: float | None) -> list[Row]:
    ex, pre, serving = build_serving(case, device)
    staged = [pre.stage(image(100 + i, size, size)) for i in range(batch)]
    payloads = sources(staged)
    grid = staged[0].grid_thw
    th, tw = grid[1] * pre.patch_size, grid[2] * pre.patch_size
    encode_ok(serving, payloads, device)  # warm: kernels, allocator, the device normalize table
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        encode_ok(serving, payloads, device)
        times.append(time.perf_counter() - t0)
    ips = batch / statistics.median(times)
    tflop = tower_flops(case.vision, grid, gated=case.gated, window=case.window) / 1e12
    frac = tflop * ips / peak if peak else None
    label = f"{case.name} bf16, {size}² -> {th}x{tw} grid {grid}, batch {batch}"
    rows = [Row("speed", label, f"{ips:.2f} img/s, {tflop:.3g} TFLOP/img"
                + (f", {frac:.0%} of {peak:.0f} TFLOP/s" if frac is not None else ""),
                f">= {TARGET_FRACTION:.0%} of peak",
                "INFO" if frac is None else ("PASS" if frac >= TARGET_FRACTION else "FAIL"))]
    first = []
    for i in range(3):
        t0 = time.perf_counter()
        s = pre.stage(image(200 + i, size, size))
        t1 = time.perf_counter()
        encode_ok(serving, sources([s]), device)
        first.append((t1 - t0, time.perf_counter() - t1))
    st, en = statistics.median(f[0] for f in first), statistics.median(f[1] for f in first)
    rows.append(Row("speed", f"{case.name} time to first embedding, batch 1",
                    f"{(st + en) * 1e3:.1f} ms (stage {st * 1e3:.1f} + encode {en * 1e3:.1f})", "-", "INFO"))
    n, nbytes, _, _ = copy_overlap(profile(lambda: encode_ok(serving, payloads, device), device))
    u8 = sum(s.pixels.numel() for s in staged) / batch
    fp32 = sum(s.pixels.shape[0] for s in staged) / batch * 3 * pre.temporal_patch_size * pre.patch_size ** 2 * 4
    per = nbytes / batch
    status = "INFO" if device.type != "cuda" else ("PASS" if u8 <= per <= 1.05 * u8 + 4096 else "FAIL")
    rows.append(Row("speed", f"{case.name} host-to-device bytes/image (serving executor)",
                    f"{per / 1e6:.2f} MB in {n} copies (uint8 {u8 / 1e6:.2f} MB, fp32 {fp32 / 1e6:.2f} MB)",
                    "~ uint8 staged bytes", status))
    rows += pipeline_rows(case, ex, pre, serving, staged, device)
    return rows


def pipeline_rows(case: TowerCase, ex: VisionExecutor, pre, serving, staged, device: torch.device) -> list[Row]:
    """Four batches back to back, no sync between them: does each upload run beside the
    previous batch's kernels? VisionExecutor (host pixels in) and the serving executor."""
    host = [pre.finish(s, None) for s in staged]  # finished on the CPU: VisionExecutor uploads them

    def direct():
        for _ in range(4):
            ex.encode(host)

    def serving_path():
        for _ in range(4):
            serving.encode(sources(staged))

    rows = []
    for name, fn in (("VisionExecutor.encode (side copy stream)", direct),
                     ("ServingExecutor.encode (finish uploads uint8)", serving_path)):
        fn()
        sync(device)
        n, nbytes, copy_us, busy_us = copy_overlap(profile(fn, device))
        frac = busy_us / copy_us if copy_us else 0.0
        result = (f"{n} HtoD copies, {nbytes / 1e6:.1f} MB, {copy_us / 1e3:.1f} ms; "
                  f"{frac:.0%} beside kernels of another stream")
        if device.type != "cuda":
            status = "INFO"
        elif name.startswith("VisionExecutor"):
            status = "PASS" if frac >= 0.5 else "FAIL"
        else:
            status = "INFO"  # its uint8 upload rides the compute stream: see docs/benchmarks.md
        rows.append(Row("pipeline", f"{case.name}: {name}", result, ">= 50% overlapped" if name[0] == "V" else "-",
                        status))
    return rows


# -- main ----------------------------------------------------------------------------------
def resolve_peak(device: torch.device, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, f"{override:.0f} TFLOP/s (--peak-tflops)"
    if device.type != "cuda":
        return None, "none (cpu: speed numbers are not meaningful)"
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAKS.items():
        if key in name:
            return peak, f"{peak:.0f} TFLOP/s dense bf16 ({name})"
    return None, f"unknown for {name!r}: pass --peak-tflops"


def guarded(section: str, what: str, fn) -> list[Row]:
    try:
        out = fn()
        return out if isinstance(out, list) else [out]
    except Exception as e:  # one broken check is a FAIL row, the others still run
        return [Row(section, what, f"{type(e).__name__}: {str(e)[:120]}", "-", "FAIL")]


def print_table(rows: list[Row]) -> None:
    cols = [("section", 8), ("check", max(len(r.check) for r in rows)), ("result", max(len(r.result) for r in rows)),
            ("target", max(len(r.target) for r in rows)), ("status", 6)]
    print(" | ".join(name.ljust(w) for name, w in cols))
    print("-+-".join("-" * w for _, w in cols))
    for r in rows:
        print(" | ".join(str(getattr(r, name)).ljust(w) for name, w in cols))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke)")
    ap.add_argument("--quick", action="store_true", help="tiny speed towers at 224², batch 2")
    ap.add_argument("--batch", type=int, default=None, help="images per speed batch (default 8; quick 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed batches (default 5; quick 2)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, overrides the GPU-name table")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: run with --device cpu --quick for the smoke mode", file=sys.stderr)
        return 2
    size, batch, reps = (224, args.batch or 2, args.reps or 2) if args.quick else (1024, args.batch or 8, args.reps or 5)
    peak, peak_note = resolve_peak(device, args.peak_tflops)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is compared at 1e-4: no TF32 GEMMs or convs
    torch.backends.cudnn.allow_tf32 = False
    start = time.perf_counter()
    print(f"gpu_check: device {device}, torch {torch.__version__}, peak {peak_note}"
          + (", QUICK (tiny sizes)" if args.quick else ""))
    rows: list[Row] = []
    for family in FAMILIES:
        rows += guarded("correct", family, lambda f=family: check_family(f, device))
    outs: list[ItemOutput] = []
    rows += guarded("cache", "device outputs", lambda: outs.extend(device_outputs(device)) or [])
    if outs:
        rows += guarded("cache", "tiered", lambda: check_tiered_cache(outs, device))
        for backend in ("shm", "tcp"):
            rows += guarded("push", backend, lambda b=backend: push_row(outs, b))
    for case in cases(args.quick):
        rows += guarded("speed", case.name, lambda c=case: speed_rows(c, device, size, batch, reps, peak))
    print_table(rows)
    print("notes: device-to-host copies for inline and pull answers run in the front's thread pool "
          "(api/app.py), for push in the sender's peer threads, never on the engine thread; L1 -> L2 "
          "cache demotions copy synchronously on the engine thread (engine/worker.py put).")
    print(f"{sum(r.status == 'FAIL' for r in rows)} FAIL of {len(rows)} rows in {time.perf_counter() - start:.0f} s")
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
