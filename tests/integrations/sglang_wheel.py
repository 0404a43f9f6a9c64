# SPDX-License-Identifier: Apache-2.0
"""Where SGLang 0.5.23's code lies for the tests: ``make sglang-wheel`` fills SGLANG_DIR.

The wheel is downloaded, never installed (it requires CUDA packages); its ``sglang/``
tree is unpacked beside it once, and the three small pure-Python-importable packages
its receiver imports (orjson, pybase64, dill) sit in ``deps/``. Absent: the tests skip.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SGLANG_DIR = ROOT / ".sglang"
VERSION = "0.5.23"


def sglang_tree() -> tuple[Path, Path]:
    """``(unpacked wheel dir, deps dir)``, or skip the test saying what is missing."""
    wheels = sorted(SGLANG_DIR.glob(f"sglang-{VERSION}-*.whl"))
    deps = SGLANG_DIR / "deps"
    if not wheels or not (deps / "orjson").is_dir():
        pytest.skip(f"sglang=={VERSION} wheel or its deps not in {SGLANG_DIR} (run `make sglang-wheel`)")
    unpacked = SGLANG_DIR / "unpacked"
    marker = unpacked / f".{wheels[-1].name}.done"
    if not marker.exists():
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(unpacked, [n for n in z.namelist() if n.startswith("sglang/")])
        marker.touch()
    return unpacked, deps
