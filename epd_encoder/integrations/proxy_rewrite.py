# SPDX-License-Identifier: Apache-2.0
"""The proxy's request rewriting (docs/proxy.md): find a chat request's media parts, and put
in their place what vLLM 0.32's chat parser takes once the encode tier has the items.

Pure functions on JSON values: no I/O, no engine import. The part shapes are vLLM's
(``vllm/renderers/chat_utils.py``): ``image_url`` (its ``image_url`` a ``{"url"}`` object or,
with a uuid or no type, a string), the Responses API's ``input_image``, ``video_url``.
vLLM refuses a request that mixes raw and embedded items of one modality, so a request is
rewritten whole or not at all.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from epd_encoder.integrations.handoff import vllm_embeds_part

if TYPE_CHECKING:
    from epd_encoder.client import EncodedItem

Modality = Literal["image", "video"]
# A part's "type" (or, untyped, the key it carries) -> the modality and the key holding its URL.
_TYPED: dict[str, tuple[Modality, str]] = {
    "image_url": ("image", "image_url"),
    "input_image": ("image", "image_url"),
    "video_url": ("video", "video_url"),
}


@dataclass(frozen=True)
class MediaPart:
    """One media content part, in prompt order: ``messages[message].content[part]``."""

    message: int
    part: int
    modality: Modality
    url: str

    def encode_item(self) -> dict:
        """The part as an item of the encode tier's ``POST /v1/encode`` (docs/api.md)."""
        kind = "image_url" if self.modality == "image" else "video_url"
        return {"type": kind, kind: {"url": self.url}}


def _url(part: dict) -> tuple[Modality, str] | None:
    kind = part.get("type")
    if kind is None or "uuid" in part:  # vLLM reads these by the key present (chat_utils)
        kind = next((k for k in ("image_url", "video_url") if k in part), None)
    if not isinstance(kind, str) or kind not in _TYPED:
        return None
    modality, field = _TYPED[kind]
    value = part.get(field)
    url = value.get("url") if isinstance(value, dict) else value
    # No URL: a uuid-only reference to an item vLLM has cached; it stays as it is.
    return (modality, url) if isinstance(url, str) and url else None


def media_parts(body: Any) -> list[MediaPart]:
    """Every media part of a chat-completions body, in prompt order; ``[]`` for a text-only
    request and for a body this module does not understand (vLLM then answers it as it is)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return []
    found = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue  # a string content has no media
        for p, part in enumerate(content):
            hit = _url(part) if isinstance(part, dict) else None
            if hit is not None:
                found.append(MediaPart(m, p, hit[0], hit[1]))
    return found


def pixel_bounds(body: dict) -> dict[str, int]:
    """``min_pixels`` / ``max_pixels`` from vLLM's ``mm_processor_kwargs``: the encode tier
    must size the images as vLLM's processor would have."""
    kwargs = body.get("mm_processor_kwargs")
    if not isinstance(kwargs, dict):
        return {}
    return {k: kwargs[k] for k in ("min_pixels", "max_pixels")
            if isinstance(kwargs.get(k), int) and not isinstance(kwargs.get(k), bool)}


def embeds_part(item: EncodedItem, original: dict) -> dict:
    """The ``image_embeds`` / ``video_embeds`` part for ``item``, built by the one builder
    (handoff.vllm_embeds_part). Its uuid is the client's if it set one, else the content key:
    vLLM then identifies the item without hashing the tensor."""
    return vllm_embeds_part(item, uuid=original.get("uuid") or item.key)


def uuid_part(key: str, original: dict) -> dict:
    """The part unchanged but for ``uuid``: vLLM's EC connector finds the item by it."""
    return {**original, "uuid": key}


def rewrite(body: dict, parts: Sequence[MediaPart], replacements: Sequence[dict]) -> dict:
    """A copy of ``body`` with each media part replaced; the client's body is left as it was."""
    if len(parts) != len(replacements):
        raise ValueError(f"{len(parts)} media parts but {len(replacements)} replacements")
    out = dict(body)
    out["messages"] = messages = copy.copy(body["messages"])
    for at, new in zip(parts, replacements):
        message = messages[at.message] = dict(messages[at.message])
        content = message["content"] = list(message["content"])
        content[at.part] = new
    return out


def original_part(body: dict, at: MediaPart) -> dict:
    return body["messages"][at.message]["content"][at.part]
