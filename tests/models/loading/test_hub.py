# SPDX-License-Identifier: Apache-2.0
"""--model as a Hub id, against a fake Hub (tests/models/fake_hub.py) serving tiny
checkpoints written by ``write_tiny_model``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from epd_encoder.bench.server import ServerProcess, free_port, serve_command
from epd_encoder.errors import CheckpointError, ConfigError
from epd_encoder.models.loading.hub import resolve
from epd_encoder.models.registry import load_vision_model
from epd_encoder.models.tiny import CHECKPOINT_VISION_PREFIXES, write_tiny_model
from tests.models.fake_hub import FakeHub, commit_of as _commit
from epd_encoder.bench.media import noise_clip
from tests.e2e.harness import b64, body, png
from tests.models.hub_layouts import prune

REPO = "org/tiny-qwen"
SINGLE_REPO = "org/tiny-single"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-src")
    return {
        "main": write_tiny_model("qwen2_vl", root / "main", seed=0, num_shards=3),
        "v1": write_tiny_model("qwen2_vl", root / "v1", seed=1, num_shards=3),
        "single": write_tiny_model("qwen2_vl", root / "single", seed=0, num_shards=1),
    }


@pytest.fixture
def hub(checkpoints):
    main, v1 = (_commit("main"), checkpoints["main"]), (_commit("v1"), checkpoints["v1"])
    single = (_commit("single"), checkpoints["single"])
    server = FakeHub({
        REPO: {"main": main, main[0]: main, "v1": v1, v1[0]: v1},
        SINGLE_REPO: {"main": single, single[0]: single},
    })
    yield server
    server.stop()


def _shards(ckpt: Path) -> tuple[set[str], set[str]]:
    """(shards holding vision tensors, LM-only shards) of a tiny checkpoint."""
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    vision = {f for n, f in weight_map.items() if n.startswith(CHECKPOINT_VISION_PREFIXES["qwen2_vl"])}
    return vision, set(weight_map.values()) - vision


def test_downloads_configs_and_vision_shards_only(hub, checkpoints, tmp_path):
    cache = tmp_path / "hf"
    r = resolve(REPO, cache_dir=cache, endpoint=hub.url)
    vision, lm = _shards(checkpoints["main"])
    assert vision and lm  # the layout this test is about: three shards, vision apart
    asked = set(hub.files(REPO))
    assert vision <= asked and "config.json" in asked and "preprocessor_config.json" in asked
    assert "model.safetensors.index.json" in asked and "video_preprocessor_config.json" in asked
    assert not asked & lm, f"LM-only shards were requested: {asked & lm}"
    assert not asked & {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert r.repo_id == REPO and r.commit == _commit("main")
    assert r.path == cache / "models--org--tiny-qwen" / "snapshots" / _commit("main")
    assert not any((r.path / f).exists() for f in lm)
    # The partial snapshot loads, to the same vision weights as the source directory.
    from_hub = load_vision_model(r.path, progress=False)
    from_dir = load_vision_model(checkpoints["main"], progress=False)
    assert from_hub.weights_digest == from_dir.weights_digest


def test_single_file_checkpoint_is_downloaded_whole(hub, tmp_path):
    r = resolve(SINGLE_REPO, cache_dir=tmp_path / "hf", endpoint=hub.url)
    assert "model.safetensors" in hub.files(SINGLE_REPO) and "model.safetensors" in r.files
    assert load_vision_model(r.path, progress=False).weights_digest


def test_revision_pin_resolves_that_revision(hub, checkpoints, tmp_path):
    cache = tmp_path / "hf"
    r = resolve(REPO, "v1", cache_dir=cache, endpoint=hub.url)
    assert r.commit == _commit("v1")
    assert (r.path / "config.json").read_bytes() == (checkpoints["v1"] / "config.json").read_bytes()
    # Every file after the first is asked for at the resolved commit, not at the tag.
    asked = [p for _, p in hub.requests]
    assert asked[0].startswith(f"/{REPO}/resolve/v1/config.json")
    assert all(p.startswith(f"/{REPO}/resolve/{_commit('v1')}/") for p in asked[1:] if "config.json" not in p[-12:])
    v1 = load_vision_model(r.path, progress=False).weights_digest
    assert v1 == load_vision_model(checkpoints["v1"], progress=False).weights_digest
    main = resolve(REPO, cache_dir=cache, endpoint=hub.url)
    assert main.commit == _commit("main") and main.path != r.path
    assert load_vision_model(main.path, progress=False).weights_digest != v1
    # A full commit hash pins as well.
    assert resolve(REPO, _commit("v1"), cache_dir=cache, endpoint=hub.url).path == r.path


def test_cache_answers_when_the_hub_is_gone(hub, checkpoints, tmp_path):
    cache = tmp_path / "hf"
    first = resolve(REPO, cache_dir=cache, endpoint=hub.url)
    hub.stop()
    # Unreachable (connection refused): huggingface_hub falls back to the cache.
    again = resolve(REPO, cache_dir=cache, endpoint=hub.url)
    assert again.path == first.path and again.commit == first.commit
    # HF_HUB_OFFLINE=1 in a fresh process (huggingface_hub reads it at import), loading too.
    code = ("import sys; from epd_encoder.models.loading.hub import resolve; "
            "from epd_encoder.models.registry import load_vision_model; "
            f"r = resolve({REPO!r}); print(r.commit, load_vision_model(r.path, progress=False).weights_digest)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": hub.url}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    commit, digest = out.stdout.split()
    assert commit == _commit("main")
    assert digest == load_vision_model(checkpoints["main"], progress=False).weights_digest
    # A revision never fetched is a clear error naming it and the cache.
    env["HF_HUB_OFFLINE"] = "1"
    code = f"from epd_encoder.models.loading.hub import resolve; resolve({REPO!r}, 'v1')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"CheckpointError: {REPO}@v1: config.json is not in the Hugging Face cache" in out.stderr
    assert "HF_HUB_OFFLINE=1" in out.stderr


@pytest.mark.slow  # ~23 s: huggingface_hub retries a file it has no cached copy of, with backoff
def test_unreachable_and_not_cached_is_a_clear_error(hub, tmp_path):
    hub.stop()
    with pytest.raises(CheckpointError, match=rf"{REPO}@main: config.json is not in the Hugging Face cache") as e:
        resolve(REPO, cache_dir=tmp_path / "hf", endpoint=hub.url)
    assert "connection error" in str(e.value) and str(tmp_path / "hf") in str(e.value)


def test_unknown_repo_and_revision(hub, tmp_path):
    with pytest.raises(CheckpointError, match="'org/nope' is neither a local directory nor a model repository"):
        resolve("org/nope", cache_dir=tmp_path / "hf", endpoint=hub.url)
    with pytest.raises(CheckpointError, match=f"{REPO} has no revision 'v9'"):
        resolve(REPO, "v9", cache_dir=tmp_path / "hf", endpoint=hub.url)


def test_local_directory_and_bad_paths(checkpoints, tmp_path):
    r = resolve(str(checkpoints["main"]))
    assert r.path == checkpoints["main"] and r.repo_id is None and r.commit is None
    with pytest.raises(ConfigError, match="--revision v1 applies to a Hub id"):
        resolve(str(checkpoints["main"]), "v1")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(str(tmp_path / "missing" / "dir"))  # an absolute path is never a Hub id
    with pytest.raises(CheckpointError, match="is a file"):
        resolve(str(checkpoints["main"] / "config.json"))


SNAPSHOT_REPO = "Qwen/tiny-Qwen2.5-VL"


@pytest.fixture
def snapshot_cache(checkpoints, tmp_path):
    """``(cache, commit, stopped hub)``: what ``hf download`` (snapshot_download) leaves for a repository
    with Qwen2.5-VL's files: blobs/, snapshots/<commit>/ and refs/main, and no .no_exist marker
    for the files it lacks (no processor_config.json, no video_preprocessor_config.json)."""
    from huggingface_hub import snapshot_download

    repo = tmp_path / "repo"
    shutil.copytree(checkpoints["main"], repo)
    prune(repo, "qwen2_5_vl")
    commit = _commit("snapshot")
    hub = FakeHub({SNAPSHOT_REPO: {"main": (commit, repo), commit: (commit, repo)}})
    cache = tmp_path / "hf"
    try:
        snapshot = Path(snapshot_download(SNAPSHOT_REPO, cache_dir=cache, endpoint=hub.url))
    finally:
        hub.stop()
    store = cache / "models--Qwen--tiny-Qwen2.5-VL"
    assert snapshot == store / "snapshots" / commit and (store / "refs" / "main").read_text() == commit
    assert any((store / "blobs").iterdir()) and not list(store.rglob(".no_exist"))
    assert {p.name for p in snapshot.iterdir()} == {p.name for p in repo.iterdir()}
    assert not (snapshot / "processor_config.json").exists()
    assert not (snapshot / "video_preprocessor_config.json").exists()
    return cache, commit, hub


def test_offline_start_from_a_snapshot_download_cache(snapshot_cache, tmp_path, monkeypatch):
    """The air-gapped set-up: ``hf download`` online, then ``serve`` under HF_HUB_OFFLINE=1.
    An optional file absent from the cache is skipped, as transformers skips it: the server
    starts and serves images, and video from the preprocessor_config.json fallback."""
    cache, commit, hub = snapshot_cache
    for name, value in {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": hub.url}.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    with ServerProcess(serve_command(SNAPSHOT_REPO, port, []), port, tmp_path / "serve.log",
                       start_timeout=180) as server:
        r = httpx.post(f"{server.url}/v1/encode", json=body(png(3)), timeout=60)
        assert r.status_code == 200, r.text
        clip = {"items": [{"type": "video", "video": b64(noise_clip(0, 0, 0, seconds=1.0, size=(64, 48)))}]}
        r = httpx.post(f"{server.url}/v1/encode", json=clip, timeout=60)
        assert r.status_code == 200, r.text
        info = httpx.get(f"{server.url}/info", timeout=10).json()
    log = (tmp_path / "serve.log").read_text()
    assert f"resolved {SNAPSHOT_REPO}@main to commit {commit}" in log
    assert "processor_config.json is not in the Hugging Face cache and the Hub cannot be reached: taken as absent" in log
    assert info["model"] == SNAPSHOT_REPO and "video" in info["features"]["modalities"]


@pytest.mark.slow  # ~23 s: one round of huggingface_hub's retries
def test_unreachable_hub_tries_once_then_takes_the_cache(snapshot_cache, checkpoints, caplog):
    """Not offline, but the Hub is gone: the first optional file the cache lacks costs one round
    of retries; the next ones are not asked for again."""
    cache, commit, hub = snapshot_cache
    with caplog.at_level(logging.INFO):
        r = resolve(SNAPSHOT_REPO, cache_dir=cache, endpoint=hub.url)
    assert r.commit == commit and "processor_config.json" not in r.files
    assert "video_preprocessor_config.json" not in r.files and "model.safetensors.index.json" in r.files
    retried = {m.rsplit("/", 1)[-1] for m in caplog.messages if "thrown while requesting" in m}
    assert "processor_config.json" in retried and retried <= {"config.json", "processor_config.json"}, retried
    assert load_vision_model(r.path, progress=False).weights_digest == load_vision_model(
        checkpoints["main"], progress=False).weights_digest
