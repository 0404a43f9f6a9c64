# SPDX-License-Identifier: Apache-2.0
"""The splitter's pure half: one encode body into per-item sub-requests, and their answers
back into one (docs/router.md). No I/O and no state: two routers split a body alike.

A body it cannot read as items (malformed, both or neither of ``items``/``messages``, an item
of an unknown shape, a bad ``request_id``, a key named twice in one object, a chat body the
server's own parser refuses) is not split: it goes whole to one server, whose
answer (a 4xx, usually) is the client's, so the error semantics are a server's own.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import struct
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import blake3
import msgspec

from epd_encoder.api.parse import decode_encode_body, refuse_duplicate_keys
from epd_encoder.errors import EncoderError

FORMAT = "epd-encoder/v1"
_RID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_SHARED = ("min_pixels", "max_pixels", "video_options", "delivery")
_MEDIA = {"image": "image", "image_url": "image_url", "video": "video", "video_url": "video_url"}
_TEXT = ("text", "input_text")
_MAX_MESSAGES, _MAX_PARTS = 256, 1024  # the server's own caps (api/parse.py): past them, it answers


class Malformed(Exception):
    """A server's answer the router cannot reassemble."""


def routing_key(value: str) -> str:
    """blake3 of the item's media bytes (base64 or data: URL decoded; a URL as its text), hex."""
    data: bytes
    if value.startswith("data:"):
        value = value.partition(",")[2]
    elif value.startswith(("http://", "https://")):
        return blake3.blake3(value.encode()).hexdigest()
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):  # the server refuses it; any server will do
        data = value.encode()
    return blake3.blake3(data).hexdigest()


@dataclass(frozen=True)
class Plan:
    """A body split per item: ``items[i]`` is sub-request i's item object, ``keys[i]`` its key."""

    request_id: str  # the client's, or one the router made
    mode: str
    shared: dict[str, Any]
    items: list[dict[str, Any]]
    keys: list[str]

    def sub_id(self, i: int) -> str:
        """Sub-request i's id: the request's for one item, else derived (unique per item)."""
        if len(self.items) == 1:
            return self.request_id
        rid = self.request_id
        if len(rid) > 100:
            rid = rid[:64] + "~" + blake3.blake3(rid.encode()).hexdigest()[:16]
        return f"{rid}:{i}"

    def sub_body(self, i: int) -> bytes:
        body: dict[str, Any] = {**self.shared, "items": [self.items[i]], "request_id": self.sub_id(i)}
        return json.dumps(body, separators=(",", ":")).encode()


def _media_value(item: dict[str, Any]) -> str | None:
    """The item's media string, or None for a shape the splitter does not know."""
    kind = item.get("type")
    if kind not in _MEDIA:
        return None
    value = item.get(kind)
    if kind.endswith("_url"):
        value = value.get("url") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _chat_items(messages: Any) -> list[dict[str, Any]] | None:
    if not isinstance(messages, list) or len(messages) > _MAX_MESSAGES:
        return None
    out: list[dict[str, Any]] = []
    parts = 0
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            parts += 1
            if not isinstance(part, dict) or parts > _MAX_PARTS:
                return None
            if part.get("type") in _TEXT:
                continue
            kind = part.get("type")
            if kind in ("image_url", "video_url") and isinstance(part.get(kind), str):
                part = {"type": kind, kind: {"url": part[kind]}}
            out.append({k: v for k, v in part.items() if k in ("type", kind)})
    return out


def plan(raw: bytes, *, max_items: int) -> Plan | None:
    """The body split per item, or None: send it whole to one server (see the module doc)."""
    try:
        body = msgspec.json.decode(raw)
        if isinstance(body, dict) and "messages" in body:
            # Rewritten as items, a chat body loses what the server checks (roles, parts' fields).
            decode_encode_body(raw, max_items=max_items)
        else:
            refuse_duplicate_keys(raw)  # re-encoding would keep only the last, hiding it from the server
    except (msgspec.DecodeError, RecursionError, EncoderError):
        return None
    if not isinstance(body, dict) or ("items" in body) == ("messages" in body):
        return None
    items = body["items"] if "items" in body else _chat_items(body["messages"])
    if not isinstance(items, list) or not 0 < len(items) <= max_items:
        return None
    rid = body.get("request_id")
    if rid is not None and not (isinstance(rid, str) and _RID.fullmatch(rid)):
        return None
    delivery = body.get("delivery")
    mode = delivery.get("mode", "inline") if isinstance(delivery, dict) else "inline"
    keys = []
    for item in items:
        value = _media_value(item) if isinstance(item, dict) else None
        if value is None:
            return None
        keys.append(routing_key(value))
    shared = {k: body[k] for k in _SHARED if k in body}
    return Plan(rid or new_request_id(), mode if isinstance(mode, str) else "inline", shared, items, keys)


def new_request_id() -> str:
    return uuid.uuid4().hex


# -- reassembly -------------------------------------------------------------------


def _safetensors(body: bytes) -> tuple[dict[str, Any], memoryview]:
    if len(body) < 8:
        raise Malformed("an inline answer shorter than a safetensors header")
    (n,) = struct.unpack_from("<Q", body, 0)
    if n > len(body) - 8:
        raise Malformed("an inline answer whose header runs past its end")
    try:
        header = json.loads(body[8:8 + n])
    except ValueError as e:
        raise Malformed("an inline answer whose header is not JSON") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise Malformed(f"an inline answer not in {FORMAT}")
    return header, memoryview(body)[8 + n:]


def merge_inline(bodies: list[bytes], request_id: str) -> bytes:
    """One inline body from one-item inline bodies, in order, without touching a tensor: each
    answer's data block is appended whole and its ``item.0.*`` names renumbered."""
    header: dict[str, Any] = {}
    metas: list[Any] = []
    blocks: list[memoryview] = []
    model, offset = "", 0
    for i, body in enumerate(bodies):
        sub, data = _safetensors(body)
        meta = sub.pop("__metadata__")
        try:
            items = json.loads(meta["items"])
        except (KeyError, TypeError, ValueError) as e:
            raise Malformed("an inline answer without its items") from e
        if not isinstance(items, list) or len(items) != 1:
            raise Malformed(f"a one-item sub-request answered {len(items) if isinstance(items, list) else '?'} items")
        metas.extend(items)
        model = model or str(meta.get("model", ""))
        for name, t in sub.items():
            if not name.startswith("item.0."):
                raise Malformed(f"an inline answer with tensor {name[:64]!r}")
            begin, end = t["data_offsets"]
            header[f"item.{i}." + name[len("item.0."):]] = {
                **t, "data_offsets": [begin + offset, end + offset]}
        offset += len(data)
        blocks.append(data)
    header = {"__metadata__": {"format": FORMAT, "model": model, "request_id": request_id,
                               "items": json.dumps(metas, separators=(",", ":"))}, **header}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([struct.pack("<Q", len(head)), head, *blocks])


def merge_json(bodies: list[bytes], sessions: list[str | None], request_id: str) -> bytes:
    """One pull or ec_store answer from one-item answers, in order. A pull item's ``url``
    carries the server that holds it (``upstream``), so a fetch through the router finds it."""
    items: list[Any] = []
    model = ""
    for body, session in zip(bodies, sessions):
        try:
            answer = json.loads(body)
            sub_items = answer["items"]
        except (ValueError, KeyError, TypeError) as e:
            raise Malformed("a JSON answer without items") from e
        if not isinstance(sub_items, list) or len(sub_items) != 1 or not isinstance(sub_items[0], dict):
            raise Malformed("a one-item sub-request answered another count of items")
        item = sub_items[0]
        if session and isinstance(item.get("url"), str):
            item["url"] = f"{item['url']}?upstream={quote(session, safe='')}"
        items.append(item)
        model = model or str(answer.get("model", ""))
    return json.dumps({"request_id": request_id, "model": model, "items": items},
                      separators=(",", ":")).encode()
