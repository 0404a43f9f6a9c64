# SPDX-License-Identifier: Apache-2.0
"""The package type-checks at the level pyproject's [tool.mypy] sets, and ships py.typed."""

from __future__ import annotations

import pathlib
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_mypy_passes_on_the_package():
    # The cache lives in .venv (ignored by git): a warm rerun takes seconds, a cold one ~30 s.
    cache = ROOT / ".venv" / ".mypy_cache" if (ROOT / ".venv").is_dir() else ROOT / ".mypy_cache"
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Success: no issues found" in run.stdout


def test_py_typed_marker_is_package_data():
    assert (ROOT / "epd_encoder" / "py.typed").is_file()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in cfg["tool"]["setuptools"]["package-data"]["epd_encoder"]


def test_every_ratchet_entry_names_a_real_module():
    # An entry for a module that was renamed or removed would silently exempt nothing.
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for override in cfg["tool"]["mypy"]["overrides"]:
        for mod in override["module"]:
            path = ROOT / (mod.replace(".", "/") + ".py")
            assert path.is_file() or (ROOT / mod.replace(".", "/")).is_dir(), mod
