# SPDX-License-Identifier: Apache-2.0
"""The ``/v1/encode`` body, decoded under structural caps before any model is built.

msgspec decodes the JSON straight into the bounded structs below: unknown
fields are skipped without being built, every list that a client can make
long is counted while it is decoded (msgspec checks ``max_length`` only after
the whole list is built), and the one free-form object (a push target's
``info``) is kept as raw JSON under a size cap. Only then, on input of at most
``max_items`` items, does pydantic build the ``EncodeBody`` that states the
rules (schemas.py) and documents them. Bodies over ``OFF_LOOP_BYTES`` are
decoded in a worker thread, so no body holds the event loop for long.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any, Union

import msgspec
import pydantic
from msgspec import UNSET, Raw, Struct, UnsetType

from epd_encoder.api.schemas import EncodeBody
from epd_encoder.errors import SchemaError, TooLarge, TooManyItems, clip
from epd_encoder.transfer import control as push

OFF_LOOP_BYTES = 64 << 10
MAX_MESSAGES = 256
MAX_PARTS = 1024  # content parts over all messages, text included
MAX_INFO_BYTES = 64 << 10  # one push target's ``info``, as JSON
TEXT_PARTS = ("text", "input_text")
MAX_JSON_VALUES = 1 << 18  # bounds what the duplicate-key check builds (refuse_duplicate_keys)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


class _Caps(threading.local):
    """The counts of the decode running on this thread; ``limits`` is None outside one."""

    limits: dict[str, int] | None = None
    counts: dict[str, int]


_caps = _Caps()


def _count(kind: str) -> None:
    limits = _caps.limits
    if limits is None:
        return
    n = _caps.counts[kind] = _caps.counts.get(kind, 0) + 1
    if n > limits[kind]:
        # Not a ValueError: msgspec passes it through as is, and stops decoding here.
        raise _ERRORS[kind](limits[kind])


_ERRORS = {
    "items": lambda n: TooManyItems(f"more than {n} items; at most {n} per request"),
    "messages": lambda n: TooLarge(f"more than {n} messages; at most {n} per request"),
    "parts": lambda n: TooLarge(f"more than {n} content parts; at most {n} per request"),
    "targets": lambda n: SchemaError(f"delivery.targets must hold 1-{n} targets"),
}


class _ImageURL(Struct):
    url: Union[str, UnsetType] = UNSET
    detail: Union[str, None, UnsetType] = UNSET


class _VideoURL(Struct):
    url: Union[str, UnsetType] = UNSET


_Number = Union[int, float, str, bool, None, UnsetType]  # pydantic's strict types give the precise 422


class _VideoOptions(Struct, forbid_unknown_fields=True):
    fps: _Number = UNSET
    min_frames: _Number = UNSET
    max_frames: _Number = UNSET
    min_pixels: _Number = UNSET
    max_pixels: _Number = UNSET


class _Item(Struct):
    type: str
    image: Union[str, None, UnsetType] = UNSET
    image_url: Union[_ImageURL, None, UnsetType] = UNSET
    video: Union[str, None, UnsetType] = UNSET
    video_url: Union[_VideoURL, None, UnsetType] = UNSET

    def __post_init__(self) -> None:
        _count("items")


class _Part(Struct):
    type: Union[str, None, UnsetType] = UNSET
    image: Union[str, UnsetType] = UNSET
    image_url: Union[_ImageURL, str, UnsetType] = UNSET
    video: Union[str, UnsetType] = UNSET
    video_url: Union[_VideoURL, str, UnsetType] = UNSET

    def __post_init__(self) -> None:
        _count("parts")
        if self.type not in TEXT_PARTS:
            _count("items")


class _Message(Struct):
    role: Union[str, UnsetType] = UNSET
    content: Union[str, list[_Part], None, UnsetType] = UNSET

    def __post_init__(self) -> None:
        _count("messages")


class _Target(Struct):
    endpoint: Union[str, UnsetType] = UNSET
    rank: Union[int, UnsetType] = UNSET
    info: Union[Raw, UnsetType] = UNSET

    def __post_init__(self) -> None:
        _count("targets")
        if self.info is not UNSET and len(self.info) > MAX_INFO_BYTES:
            raise SchemaError(f"delivery.targets[].info is over {MAX_INFO_BYTES} bytes of JSON")


class _Delivery(Struct):
    mode: Union[str, UnsetType] = UNSET
    backend: Union[str, None, UnsetType] = UNSET
    room: Union[str, int, None, UnsetType] = UNSET
    targets: Union[list[_Target], None, UnsetType] = UNSET
    bootstrap_timeout: Union[int, float, None, UnsetType] = UNSET


class _Body(Struct):
    request_id: Union[str, None, UnsetType] = UNSET
    items: Union[list[_Item], None, UnsetType] = UNSET
    messages: Union[list[_Message], None, UnsetType] = UNSET
    min_pixels: Union[int, float, str, None, UnsetType] = UNSET
    max_pixels: Union[int, float, str, None, UnsetType] = UNSET
    video_options: Union[_VideoOptions, None, UnsetType] = UNSET
    delivery: Union[_Delivery, UnsetType] = UNSET


_DECODER = msgspec.json.Decoder(_Body)


async def parse_encode_body(raw: bytes, *, max_items: int) -> EncodeBody:
    """``decode_encode_body`` in a worker thread for big bodies; raises typed errors."""
    if len(raw) <= OFF_LOOP_BYTES:
        return decode_encode_body(raw, max_items=max_items)
    return await asyncio.get_running_loop().run_in_executor(
        None, lambda: decode_encode_body(raw, max_items=max_items))


def decode_encode_body(raw: bytes, *, max_items: int) -> EncodeBody:
    """The body as an ``EncodeBody``. ``TooManyItems`` / ``TooLarge`` (413) as soon as a cap is
    passed, ``SchemaError`` (422) with one bounded message for anything else malformed."""
    _caps.limits = {"items": max_items, "messages": MAX_MESSAGES, "parts": MAX_PARTS,
                    "targets": push.MAX_TARGETS}
    _caps.counts = {}
    try:
        wire = _DECODER.decode(raw)
    except msgspec.ValidationError as e:  # a DecodeError too: caught first. Names a place, never the input
        raise SchemaError(_where_first(str(e))) from None
    except msgspec.DecodeError as e:
        raise SchemaError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise SchemaError("the body is nested too deeply") from None
    finally:
        _caps.limits = None
    refuse_duplicate_keys(raw)
    return _validate(_plain(wire))


def refuse_duplicate_keys(raw: bytes) -> None:
    """``SchemaError`` when an object anywhere in ``raw`` names a key twice.

    msgspec (like most parsers) keeps the last; a gateway that reads the first would see
    another request than the one served. The stdlib's C parser hands over every object's
    pairs, each object dropped once checked. Unlike msgspec it builds what it reads, unknown
    fields included: it reads a skeleton without the long string values, whose JSON values
    are bounded first (``TooLarge``).
    """
    skeleton = _skeleton(raw)
    values = _json_values(skeleton)
    if values > MAX_JSON_VALUES:
        raise TooLarge(f"the body holds {values} JSON values (objects, arrays and their "
                       f"elements); at most {MAX_JSON_VALUES}")
    try:  # numbers stay strings: msgspec has read the ones we use, and a 5000-digit int is valid JSON
        json.loads(skeleton, object_pairs_hook=_unique_keys, parse_int=str, parse_float=str)
    except RecursionError:
        raise SchemaError("the body is nested too deeply") from None
    except ValueError as e:  # invalid UTF-8 in a field msgspec skipped unread; messages name a place
        raise SchemaError(f"the body is not valid JSON: {e}") from None


def _skeleton(raw: bytes) -> bytes:
    """``raw`` (valid JSON) with each string value over 64 bytes emptied, keys kept, found by a
    split at the quotes. ``raw`` itself when it has a backslash (an escaped quote would not end
    its string), no long string, or more strings than the value cap allows."""
    if b"\\" in raw:
        return raw
    parts = raw.split(b'"')  # even indices: outside strings; odd: a string's content
    if len(parts) > 4 * MAX_JSON_VALUES + 3 or max(map(len, parts[1::2]), default=0) <= 64:
        return raw
    for i in range(1, len(parts) - 1, 2):
        if len(parts[i]) > 64 and not parts[i + 1].lstrip().startswith(b":"):
            parts[i] = b""
    return b'"'.join(parts)


def _json_values(raw: bytes) -> int:
    """At least the objects, arrays and elements in ``raw`` (valid JSON): ``{``, ``[`` and
    ``,``. Counted again outside strings when the bytes alone pass the cap (prose has commas)."""
    n = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if n > MAX_JSON_VALUES:
        skeleton = _STRING.sub(b'""', raw)
        n = skeleton.count(b"{") + skeleton.count(b"[") + skeleton.count(b",")
    return n


def _unique_keys(pairs: list[tuple[str, Any]]) -> None:
    if len(pairs) > 1 and len({key for key, _ in pairs}) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise SchemaError(f"duplicate key {clip(key)} in one object of the body; "
                                  "each key may appear once")
            seen.add(key)


def _where_first(message: str) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.a[0].b`" as pydantic's errors read: "a.0.b: ..."."""
    what, sep, where = message.rpartition(" - at `$")
    if not sep:
        return message
    path = re.sub(r"\[(\d+)\]", r".\1", where.rstrip("`")).lstrip(".")
    return f"{path}: {what}" if path else what


def _validate(data: dict[str, Any]) -> EncodeBody:
    try:
        return EncodeBody.model_validate(data)
    except pydantic.ValidationError as e:
        # Bounded by the caps above; only the first error is reported.
        first = e.errors(include_url=False, include_input=False, include_context=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise SchemaError(f"{where}: {first.get('msg', 'invalid request')}") from None


def _plain(value: Any) -> Any:
    """Structs as dicts without their unset fields (what pydantic would have seen, less unknown keys)."""
    if isinstance(value, Struct):
        out = {}
        for name in value.__struct_fields__:
            field = getattr(value, name)
            if field is not UNSET:
                out[name] = _plain(field)
        return out
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Raw):
        return msgspec.json.decode(value)  # at most MAX_INFO_BYTES, checked while decoding
    return value


def request_doc() -> dict:
    """The OpenAPI ``requestBody`` of /v1/encode: ``EncodeBody``'s schema, its refs pointing into itself."""
    here = "#/paths/~1v1~1encode/post/requestBody/content/application~1json/schema/$defs/{model}"
    schema = EncodeBody.model_json_schema(ref_template=here)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
