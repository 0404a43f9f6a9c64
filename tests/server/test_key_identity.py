# SPDX-License-Identifier: Apache-2.0
"""Content keys name a checkpoint by what it computes, not where it is mounted or what it is called.

Real servers: two copies of one tiny checkpoint under different directory names
(so different display names), one with other weights, and a CLI server
subprocess fetching the same checkpoint from a fake Hub by id.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest

from epd_encoder.models.tiny import write_tiny_model
from tests.e2e.harness import Server, body, png, serve_config, wait_for
from tests.models.fake_hub import FakeHub, commit_of

REPO = "org/tiny-qwen"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mounts")
    a = write_tiny_model("qwen2_vl", root / "replica-a" / "qwen-tiny", seed=0, num_shards=3)
    b = shutil.copytree(a, root / "elsewhere" / "renamed-copy")
    other = write_tiny_model("qwen2_vl", root / "replica-c" / "qwen-tiny", seed=1, num_shards=3)
    return a, b, other


def _encode(url: str, data: bytes) -> tuple[str, str]:
    """(content key, display model) of one pull-mode encode."""
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/encode", json=body(data, delivery={"mode": "pull"}))
        assert r.status_code == 200, r.text
        return r.json()["items"][0]["key"], r.json()["model"]


def _serve(model_dir):
    config = serve_config(model_dir)
    return Server(replace(config, model=replace(config.model, model_id=None))).start()


def test_copies_share_keys_and_other_weights_do_not(dirs):
    a, b, other = dirs
    data = png(7)
    keys, models = [], []
    for d in (a, b, other):
        s = _serve(d)
        try:
            key, model = _encode(s.url, data)
        finally:
            s.stop()
        keys.append(key)
        models.append(model)
    assert models == ["qwen-tiny", "renamed-copy", "qwen-tiny"]  # display names follow the directory
    assert keys[0] == keys[1], "the same checkpoint at another path must give the same key"
    assert keys[2] != keys[0], "other vision weights (same configs, same name) must give another key"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_hub_id_serves_the_directory_keys_fetching_no_lm_shard(dirs, tmp_path):
    a = dirs[0]
    data = png(7)
    s = _serve(a)
    try:
        dir_key, _ = _encode(s.url, data)
    finally:
        s.stop()
    commit = commit_of("main")
    hub = FakeHub({REPO: {"main": (commit, a), commit: (commit, a)}})
    port = _free_port()
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "epd_encoder.cli", "serve", "--model", REPO,
                             "--revision", "main", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"the server exited: {proc.stderr.read()}"
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(ready, 120)
        hub_key, model = _encode(url, data)
    finally:
        proc.terminate()
        proc.wait(30)
        hub.stop()
    assert model == REPO  # the display name defaults to the Hub id, not the commit directory
    assert hub_key == dir_key
    asked = set(hub.files(REPO))
    assert "model-00001-of-00003.safetensors" in asked  # the vision shard (vision first)
    assert not asked & {"model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"}
