# SPDX-License-Identifier: Apache-2.0
"""The prepared GPU scripts (benchmarks/gpu_check.py, tp_gpu_check.py): their CPU smoke modes run
every row without a FAIL (tp_gpu_check's dead-rank rows included, on gloo), and the pieces whose CUDA inputs the CPU cannot produce (the FLOP
count, the profiler-trace overlap) are checked on their own."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def table(stdout: str) -> list[list[str]]:
    """The table's data rows, split into cells (the header and rule skipped)."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("section "))
    rows = []
    for line in lines[head + 2:]:
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) != 5:
            break
        rows.append(cells)
    return rows


def run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_gpu_check_smoke_prints_every_row_without_a_fail():
    gc = load("gpu_check")
    proc = run("gpu_check.py", "--device", "cpu", "--quick", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table(proc.stdout)
    checks = [r[1] for r in rows]
    for family in gc.FAMILIES:
        assert f"{family} transformers vs ours, cpu fp32" in checks
        assert f"{family} cpu float32 vs cpu fp32" in checks and f"{family} cpu bfloat16 vs cpu fp32" in checks
    assert sum(r[0] == "cache" for r in rows) == 2
    assert {c.split(" from ")[0] for c in checks if c.startswith(("shm", "tcp"))} == {"shm", "tcp"}
    for case in gc.cases(quick=True):
        mine = [c for c in checks if c.startswith(case.name)]
        assert len(mine) == 5, mine  # throughput, first embedding, H2D bytes, two overlap rows
    assert len(rows) == 3 * len(gc.FAMILIES) + 2 + 2 + 5 * len(gc.cases(quick=True))
    assert {r[4] for r in rows} <= {"PASS", "INFO"}
    assert all(r[4] == "PASS" for r in rows if r[0] in ("correct", "cache", "push"))


@pytest.mark.slow
def test_tp_gpu_check_smoke_runs_both_modes_equal_to_tp1():
    proc = run("tp_gpu_check.py", "--device", "cpu", "--quick", "--timeout", "60", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table(proc.stdout)
    equal = [r for r in rows if r[0] == "equal"]
    assert len(equal) == 4 and all(r[4] == "PASS" for r in equal)
    assert {re.search(r"--tp 2 (\w+)", r[1]).group(1) for r in equal} == {"weights", "data"}
    speed = [r[1].split()[:2] for r in rows if r[0] == "speed"]
    assert speed == [["tp1", "tiny"], ["tp2", "weights"], ["tp2", "data"]]
    assert "collective backend: gloo" in proc.stdout
    # A rank killed mid-forward: RankFailed in the caller, the group failed, close() returns.
    fail = [r for r in rows if r[0] == "fail"]
    assert len(fail) == 3 and all(r[4] == "PASS" for r in fail), fail
    assert "(gloo)" in fail[0][1] and fail[0][2].startswith("RankFailed after"), fail


def test_the_7b_tower_costs_about_7_7_tflop_per_1024_image():
    gc = load("gpu_check")
    from epd_encoder.preprocess.qwen import QwenPreprocessor

    q25, q3 = gc.cases(quick=False)
    grid, _ = QwenPreprocessor.from_config(q25.pre).predict(1024, 1024)
    assert grid == (1, 74, 74)  # smart_resize: 1036 x 1036
    assert 7.6e12 < gc.tower_flops(q25.vision, grid, gated=True, window=True) < 7.8e12
    grid3, _ = QwenPreprocessor.from_config(q3.pre).predict(1024, 1024)
    assert grid3 == (1, 64, 64)
    # No window attention: every layer attends over all 4096 patches.
    assert gc.tower_flops(q3.vision, grid3, gated=False, window=False) > 5e12


def test_copy_overlap_counts_only_kernels_of_other_streams():
    gc = load("gpu_check")
    copy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 100, "dur": 100,
            "args": {"stream": 7, "bytes": 4096}}
    kernels = [
        {"cat": "kernel", "name": "a", "ts": 50, "dur": 100, "args": {"stream": 1}},   # 100..150 beside
        {"cat": "kernel", "name": "b", "ts": 120, "dur": 60, "args": {"stream": 1}},   # 150..180 beside
        {"cat": "kernel", "name": "c", "ts": 100, "dur": 100, "args": {"stream": 7}},  # its own stream
        {"cat": "kernel", "name": "d", "ts": 250, "dur": 10, "args": {"stream": 1}},   # after it
    ]
    d2h = dict(copy, name="Memcpy DtoH (Device -> Pinned)")
    n, nbytes, copy_us, busy_us = gc.copy_overlap([copy, d2h, *kernels])
    assert (n, nbytes, copy_us, busy_us) == (1, 4096, 100, 80)
