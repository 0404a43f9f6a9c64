# SPDX-License-Identifier: Apache-2.0
"""Why vLLM's own reader of the shared tier cannot run here (run in the vLLM venv, no engine).

``python vllm_cross_cache_probe.py MODEL`` builds the config of an encoder-only
``ECMooncakeConnector`` producer with ``cross_encoder_cache`` as vLLM does at start (the engine
config, then the connector's own ``MooncakeECConfig``) and prints, as JSON, the error vLLM raised
or null where it accepted. The caller sets ``VLLM_USE_V2_MODEL_RUNNER`` or not.
"""

from __future__ import annotations

import json
import sys


def attempt(model: str) -> str | None:
    from vllm.distributed.ec_transfer.ec_connector.mooncake.config import MooncakeECConfig
    from vllm.engine.arg_utils import EngineArgs

    config = {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer", "ec_buffer_device": "cpu",
              "ec_connector_extra_config": {"cross_encoder_cache": True, "mooncake_protocol": "tcp"}}
    try:
        vllm_config = EngineArgs(model=model, dtype="float32", max_model_len=1024, enforce_eager=True,
                                 ec_transfer_config=config).create_engine_config()
        MooncakeECConfig.from_vllm_config(vllm_config)  # what its scheduler and worker build first
    except Exception as e:  # noqa: BLE001  (the refusal is the result)
        return f"{type(e).__name__}: {e}"[:2000]
    return None


if __name__ == "__main__":
    print(json.dumps({"error": attempt(sys.argv[1])}))
