# SPDX-License-Identifier: Apache-2.0
"""Our own EC connector (epd_encoder.integrations.vllm) loaded by real vLLM 0.32 through
``ec_connector_module_path``: it pulls each item from the encode tier by key. A consumer whose
vision tower is noise answers as vLLM does on the true checkpoint; an encode tier that is down,
slow or has lost the key fails that request (``on_missing: error``) or lets vLLM encode it
(``on_missing: local``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.e2e.harness import Server, serve_config
from tests.integrations.vllm_ec_common import (  # noqa: F401  (session fixtures)
    TOL,
    Relay,
    encode,
    max_diff,
    models_for,
    needs_vllm,
    reference_for,
    run_vllm,
    true_reference,
    vllm_models,
)

pytestmark = [needs_vllm(), pytest.mark.slow, pytest.mark.timeout(1500)]  # vLLM starts: ~100 s each here
LOST = "0" * 64  # a well-formed key the encode tier never produced
TIMEOUT_S = 3.0  # the connector's fetch timeout; the stalled relay never answers


def _connector(url: str, on_missing: str) -> dict:
    return {"ec_connector": "EPDEncoderConnector", "ec_connector_module_path": "epd_encoder.integrations.vllm",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"encoder_url": url, "on_missing": on_missing, "timeout": TIMEOUT_S}}


@pytest.fixture(scope="module")
def tier(vllm_models):
    """The encode tier behind a relay the tests can make reset or stall; the items' keys."""
    true, _, imgs = vllm_models
    server = Server(replace(serve_config(true), pull_ttl=3600.0)).start()
    relay = Relay(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    try:
        yield relay, [encode(server.url, p, "pull")["key"] for p in imgs]
    finally:
        relay.close()
        server.stop()


def test_on_missing_error_fails_only_the_request_whose_item_is_unavailable(vllm_models, true_reference, tier,
                                                                            tmp_path):
    _, noise, imgs = vllm_models
    relay, keys = tier
    modes = {"down": "reset", "slow": "stall", "back": "forward"}

    def on_gate(name: str) -> None:
        relay.mode = modes[name]

    spec = {"model": str(noise), "ec_transfer_config": _connector(relay.url, "error"), "requests": [
        {"image": str(imgs[0]), "uuid": keys[0]},
        {"image": str(imgs[1]), "uuid": keys[1]},
        {"image": str(imgs[0]), "uuid": LOST},
        {"image": str(imgs[2]), "uuid": keys[2], "gate": "down"},
        {"image": str(imgs[2]), "uuid": keys[2], "gate": "slow"},
        {"image": str(imgs[2]), "uuid": keys[2], "gate": "back"},
    ]}
    got = run_vllm(tmp_path, "connector_error", spec, on_gate=on_gate)
    for ref, res in ((true_reference[0], got[0]), (true_reference[1], got[1]), (true_reference[2], got[5])):
        assert res["ok"], res
        assert res["token_ids"] == ref["token_ids"]
        assert max_diff(ref, res) <= TOL
    assert [r["ok"] for r in got[2:5]] == [False, False, False], got[2:5]
    log = (tmp_path / "connector_error.log").read_text()
    assert f"answered 404 for key {LOST}" in log  # lost key
    assert "unreachable or slow" in log and "timed out" in log  # down, then slow


def test_on_missing_local_encodes_with_the_consumers_own_tower(vllm_models, true_reference, tier, tmp_path):
    _, noise, imgs = vllm_models
    relay, keys = tier

    def on_gate(name: str) -> None:
        relay.mode = {"down": "reset", "back": "forward"}[name]

    spec = {"model": str(noise), "ec_transfer_config": _connector(relay.url, "local"), "requests": [
        {"image": str(imgs[0]), "uuid": keys[0], "gate": "down"},
        {"image": str(imgs[1]), "uuid": keys[1], "gate": "back"},
    ]}
    got = run_vllm(tmp_path, "connector_local", spec, on_gate=on_gate)
    assert all(r["ok"] for r in got), got
    # Down: the noise tower encoded it (the control: noise changes the answer).
    assert max_diff(true_reference[0], got[0]) > 100 * TOL
    # Back: the item comes from the tier again.
    assert got[1]["token_ids"] == true_reference[1]["token_ids"]
    assert max_diff(true_reference[1], got[1]) <= TOL


def test_deepstack_items_pulled_by_key_match_the_true_checkpoint(tmp_path_factory, tmp_path):
    """Qwen3-VL: the connector concatenates deepstack on the hidden axis and checks that width."""
    true, noise, imgs = models_for("qwen3_vl", tmp_path_factory)
    reference = reference_for("qwen3_vl", tmp_path_factory)
    server = Server(serve_config(true)).start()
    try:
        keys = [encode(server.url, p, "pull")["key"] for p in imgs]
        spec = {"model": str(noise), "ec_transfer_config": _connector(server.url, "error"),
                "requests": [{"image": str(p), "uuid": k} for p, k in zip(imgs, keys)]}
        got = run_vllm(tmp_path, "connector_qwen3_vl", spec)
    finally:
        server.stop()
    for ref, res in zip(reference, got):
        assert res["ok"], res
        assert res["token_ids"] == ref["token_ids"]
        assert max_diff(ref, res) <= TOL
