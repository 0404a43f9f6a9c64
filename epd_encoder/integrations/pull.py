# SPDX-License-Identifier: Apache-2.0
"""Fetch one pulled item from the encode tier with the standard library only, as vLLM's
connector (integrations/vllm.py) does inside the user's vLLM environment."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING

from epd_encoder.wire import unpack_item

if TYPE_CHECKING:
    import torch

__all__ = ["UnavailableItem", "fetch_rows"]


class UnavailableItem(Exception):
    """The encode tier could not give an item's output: down, slow, unknown key, wrong shape."""


def fetch_rows(url: str, key: str, *, timeout: float, api_key: str | None = None) -> torch.Tensor:
    """``GET {url}/v1/embeddings/{key}`` as ``[num_tokens, hidden * (1 + num_deepstack)]``.

    ``timeout`` bounds the connect and each socket read. Raises ``UnavailableItem`` with the
    reason (HTTP status, refused, timed out, a body for another key).
    """
    # The key is vLLM's identifier, a client's uuid when one was given: any string, one segment.
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/embeddings/{urllib.parse.quote(key, safe='')}")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        raise UnavailableItem(f"the encode tier at {url} answered {e.code} for key {key}") from e
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
        reason = getattr(e, "reason", e)
        raise UnavailableItem(f"the encode tier at {url} is unreachable or slow for key {key}: {reason}") from e
    try:
        _, meta, output = unpack_item(body)
    except Exception as e:  # a truncated or foreign body: the item is unavailable, not the engine
        raise UnavailableItem(f"the encode tier's body for key {key} does not parse: {e}") from e
    if meta.key != key:
        raise UnavailableItem(f"asked for key {key}, the encode tier answered {meta.key}")
    return output.joined()
