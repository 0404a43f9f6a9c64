# SPDX-License-Identifier: Apache-2.0
"""Shared pieces of the vLLM EC tests: the vLLM venv, checkpoints with a noise vision tower,
one driver run per vLLM start (vllm_ec_driver.py), and a relay that plays a sick encode tier."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_ec_driver.py")
TOL = 1e-5  # fp32 prompt logprobs, the bound
SIZES = [(56, 84), (112, 56), (84, 84)]


def needs_vllm() -> pytest.MarkDecorator:
    from tests.integrations.vllm_harness import missing_reason

    reason = missing_reason()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def noise_copy(src: Path, dst: Path, seed: int = 1) -> Path:
    """``src`` with every vision weight replaced by noise: a consumer that still encodes says so."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        tensors = {k: (torch.randn(v.shape, generator=g).to(v.dtype) * 0.5 if k.startswith(("visual.", "model.visual."))
                       else v) for k, v in tensors.items()}
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def images(out: Path) -> list[Path]:
    paths = []
    for i, (h, w) in enumerate(SIZES):
        p = out / f"img{i}.png"
        Image.fromarray((np.random.default_rng(i).random((h, w, 3)) * 255).astype("uint8")).save(p)
        paths.append(p)
    return paths


def encode(url: str, path: Path, mode: str) -> dict:
    body = {"items": [{"type": "image", "image": base64.b64encode(path.read_bytes()).decode()}],
            "delivery": {"mode": mode}}
    r = httpx.post(f"{url}/v1/encode", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["items"][0]


def run_vllm(tmp: Path, name: str, spec: dict, on_gate=None, timeout: float = 900,
             env: dict[str, str] | None = None) -> list[dict]:
    """One vLLM start; ``on_gate(name)`` runs when the driver waits at a gated request; ``env`` is
    added to the driver's environment."""
    spec_path, out = tmp / f"{name}.json", tmp / f"{name}.out"
    spec_path.write_text(json.dumps(spec))
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen([str(VLLM_PY), str(DRIVER), str(spec_path), str(out)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=tmp, env={**os.environ, **(env or {})})
    gates = [r["gate"] for r in spec["requests"] if r.get("gate")]
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM run {name} took over {timeout} s")
            for g in list(gates):
                if Path(f"{out}.{g}.ready").exists():
                    gates.remove(g)
                    if on_gate is not None:
                        on_gate(g)
                    Path(f"{out}.{g}.go").touch()
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    if proc.returncode != 0:
        raise AssertionError(f"vLLM run {name} exited {proc.returncode}:\n"
                             + (tmp / f"{name}.log").read_text()[-4000:])
    return json.loads(out.read_text())


def max_diff(a: dict, b: dict) -> float:
    la, lb = a["prompt_logprobs"][1:], b["prompt_logprobs"][1:]
    assert len(la) == len(lb) > 0
    return max(abs(x - y) for x, y in zip(la, lb))


class Relay:
    """A TCP relay in front of the encode tier: ``forward``, ``reset`` (accept and drop: the
    tier is down) or ``stall`` (accept and never answer: the tier is slow)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream, self.mode = upstream, "forward"
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
            elif self.mode == "stall":
                self._held.append(conn)
            else:
                up = socket.create_connection(self.upstream)
                for a, b in ((conn, up), (up, conn)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        for c in self._held:
            c.close()


# -- session fixtures, imported by the test modules. A fixture imported into two modules is two
# fixtures to pytest, so the work is memoized here: one true-checkpoint vLLM start per session.
_MEMO: dict[tuple[str, str], object] = {}


def models_for(family: str, tmp_path_factory) -> tuple[Path, Path, list[Path]]:
    """(true checkpoint, its noise-tower copy, the images) of a tiny ``family``, once per session."""
    from epd_encoder.models.tiny import write_tiny_model

    if ("models", family) not in _MEMO:
        base = tmp_path_factory.mktemp(f"vllm_ec_{family}")
        true = write_tiny_model(family, base / "true", vllm_compatible=True)
        _MEMO["models", family] = (true, noise_copy(true, base / "noise"), images(base))
    return _MEMO["models", family]  # type: ignore[return-value]


def reference_for(family: str, tmp_path_factory) -> list[dict]:
    """vLLM aggregated on the true checkpoint: one result per image, in order; once per session."""
    if ("true", family) not in _MEMO:
        true, _, imgs = models_for(family, tmp_path_factory)
        spec = {"model": str(true), "requests": [{"image": str(p)} for p in imgs]}
        results = run_vllm(tmp_path_factory.mktemp(f"vllm_true_{family}"), "true", spec)
        assert all(r["ok"] for r in results), results
        _MEMO["true", family] = results
    return _MEMO["true", family]  # type: ignore[return-value]


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory):
    """Tiny Qwen2.5-VL: (true checkpoint, noise-tower copy, images)."""
    return models_for("qwen2_5_vl", tmp_path_factory)


@pytest.fixture(scope="session")
def true_reference(tmp_path_factory):
    """vLLM on the true tiny Qwen2.5-VL, one result per image."""
    return reference_for("qwen2_5_vl", tmp_path_factory)
