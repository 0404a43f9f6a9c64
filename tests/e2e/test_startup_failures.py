# SPDX-License-Identifier: Apache-2.0
"""`epd-encoder serve` that cannot serve exits non-zero within seconds, saying why in one line.

Real subprocesses, as systemd or Kubernetes run them: a server that stayed up answering 503
would never be restarted or reported. Exit 2: a setting wrong before anything loads (printed
as ``error:`` first); exit 1: the model failed to load; exit 3: the port is taken (an ERROR line).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEADLINE = 90.0  # seconds; a load failure takes ~4 s on a quiet 2-core box (torch import included)
EXE = Path(sys.executable).with_name("epd-encoder")
BASE = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "epd_encoder.cli"]


def serve(*argv: str, env: dict | None = None, cwd=None) -> tuple[int, str, float]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_ENCODER_")}
    full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    t0 = time.monotonic()
    r = subprocess.run([*BASE, "serve", "--port", "0", *argv], env=full_env, cwd=cwd,
                       capture_output=True, text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL)
    return r.returncode, r.stderr, time.monotonic() - t0


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ERROR " in line or ": error: " in line]


@pytest.mark.parametrize("argv,env,cause", [
    (["--max-batch-cost", "0"], {}, "--max-batch-cost must be > 0, got 0"),
    ([], {"EPD_ENCODER_MAX_BATCH_COST": "-5"}, "(--max-batch-cost from EPD_ENCODER_MAX_BATCH_COST)"),
    (["--port", "http"], {}, "argument --port: invalid int value: 'http'"),
    (["--device", "tpu"], {}, "--device must be auto, cpu, cuda or cuda:N"),
    (["--model", "/nonexistent/qwen"], {}, "--model /nonexistent/qwen: no such directory, and not a Hugging Face Hub id"),
    (["--model", "./not/../a hub id"], {}, "no such directory, and not a Hugging Face Hub id"),
])
def test_a_wrong_setting_is_one_error_line_and_exit_2(argv, env, cause):
    rc, err, took = serve(*argv, env=env)
    assert rc == 2, err
    assert err.splitlines()[0].startswith("epd-encoder serve: error: ") and cause in err.splitlines()[0], err
    assert "Traceback" not in err and took < 30, (took, err)


def test_an_unknown_toml_key_is_refused_before_loading(tmp_path):
    (tmp_path / "epd.toml").write_text("max-batch-cost = 4096\n[limits]\nmax_items = 8\n")
    rc, err, _ = serve("--config", str(tmp_path / "epd.toml"))
    assert rc == 2 and "unknown key 'limits'" in error_lines(err)[-1] and "Traceback" not in err, err


def test_an_empty_model_directory_is_named_as_such(tmp_path):
    rc, err, _ = serve("--model", str(tmp_path))
    assert rc == 2 and "the directory is empty, so it is not a Hugging Face checkpoint" in error_lines(err)[-1], err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is present: --device cuda would load")
def test_device_cuda_without_cuda_fails_before_loading():
    rc, err, took = serve("--device", "cuda")
    assert rc == 2 and "--device cuda: CUDA is not available" in error_lines(err)[-1] and took < 30, err


def test_an_unsupported_model_exits_1_naming_the_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    rc, err, took = serve("--model", str(tmp_path))
    assert rc == 1, err
    last = error_lines(err)[-1]
    assert "model failed to load: model_type 'bert' is not supported" in last, err
    assert "Traceback" not in err and len(error_lines(err)) == 1, err
    assert took < DEADLINE


def test_a_checkpoint_without_weights_exits_1(tiny_dir, tmp_path):
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_dir, broken, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    rc, err, _ = serve("--model", str(broken))
    assert rc == 1 and "model failed to load: " in error_lines(err)[-1] and "Traceback" not in err, err


def test_the_traceback_is_shown_at_log_level_debug(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    rc, err, _ = serve("--model", str(tmp_path), "--log-level", "debug")
    assert rc == 1 and "Traceback" in err and "model_type 'bert' is not supported" in err, err


def test_a_port_in_use_exits_3_saying_so(tiny_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, err, _ = serve("--model", str(tiny_dir), "--port", str(port))
    assert rc == 3, err  # uvicorn's STARTUP_FAILURE
    assert "address already in use" in error_lines(err)[-1], err
    assert "Traceback" not in err, err
