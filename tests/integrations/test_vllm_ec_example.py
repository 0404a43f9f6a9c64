# SPDX-License-Identifier: Apache-2.0
"""ec_store delivery into vLLM's ECExampleConnector layout, proven against real vLLM 0.32:
a consumer whose vision tower is noise answers exactly as vLLM on the true checkpoint."""

from __future__ import annotations

from dataclasses import replace

import pytest

from epd_encoder.config.ec_store import ECStoreConfig
from tests.e2e.harness import Server, serve_config
from tests.integrations.vllm_ec_common import TOL, encode, max_diff, models_for, needs_vllm, reference_for, run_vllm

pytestmark = [needs_vllm(), pytest.mark.slow, pytest.mark.timeout(1500)]  # vLLM starts: ~100 s each here


# Qwen3-VL: each file holds the embedding with its deepstack tensors on the hidden axis.
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_noise_tower_consumer_reads_our_files_and_matches_the_true_checkpoint(family, tmp_path_factory,
                                                                              tmp_path):
    true, noise, imgs = models_for(family, tmp_path_factory)
    true_reference = reference_for(family, tmp_path_factory)
    store = tmp_path / "store"
    server = Server(replace(serve_config(true), ec_store=ECStoreConfig(ec_store_path=str(store)))).start()
    try:
        items = [encode(server.url, p, "ec_store") for p in imgs]
    finally:
        server.stop()
    for it in items:
        assert (store / it["key"] / "encoder_cache.safetensors").is_file()
    spec = {"model": str(noise),
            "ec_transfer_config": {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
                                   "ec_connector_extra_config": {"shared_storage_path": str(store)}},
            "requests": [{"image": str(p), "uuid": it["key"]} for p, it in zip(imgs, items)]
                        + [{"image": str(imgs[0])}]}  # control: no uuid, the noise tower encodes
    got = run_vllm(tmp_path, "ec_example", spec)
    for ref, res in zip(true_reference, got):
        assert res["ok"], res
        assert res["token_ids"] == ref["token_ids"]
        assert max_diff(ref, res) <= TOL
    control = got[-1]
    assert control["ok"] and max_diff(true_reference[0], control) > 100 * TOL
