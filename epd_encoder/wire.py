# SPDX-License-Identifier: Apache-2.0
"""The embedding wire format: the one place that packs and unpacks bodies.

A body is a safetensors file (little-endian, 8-byte header length, JSON
header, raw tensor bytes). Two shapes of body exist:

* inline (``POST /v1/encode``): tensors ``item.{i}.embedding`` and
  ``item.{i}.deepstack.{j}``; ``__metadata__`` holds ``format``
  (``epd-encoder/v1``), ``model``, ``request_id`` and ``items`` (a JSON list of
  ``ItemMeta.to_json()`` objects, one per item, in request order);
* item (``GET /v1/embeddings/{key}``): tensors ``embedding`` and
  ``deepstack.{j}``; ``__metadata__`` holds ``format``, ``model`` and ``item``
  (one JSON object).

Every tensor of an item is ``[num_tokens, hidden_size]`` in the item's dtype;
``num_deepstack == 0`` means ``ItemOutput.deepstack is None``. Packing copies
each tensor's bytes exactly once, into the body (a device tensor is first
staged on the host). Unpacking never lets a parse error leak: anything that
does not match the metadata raises ``SchemaError``.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from epd_encoder.errors import EncodeFailed, SchemaError
from epd_encoder.types import ItemOutput

if TYPE_CHECKING:  # torch is imported on first use: metadata-only users (the client) stay light
    import torch

FORMAT = "epd-encoder/v1"
CacheState = Literal["hit", "miss", "coalesced"]

_CACHE_STATES = ("hit", "miss", "coalesced")
_TIERS = ("device", "host", "shared")  # where a hit was found: L1, L2, the fleet's L3
# wire name -> safetensors dtype code; the torch dtype is ``getattr(torch, name)``.
_DTYPES: dict[str, str] = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_MAX_HEADER = 100 << 20  # safetensors' own bound on header size


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; ``EncodeFailed`` for one the wire lacks."""
    import torch

    name = str(dtype).removeprefix("torch.")
    if not isinstance(dtype, torch.dtype) or name not in _DTYPES:
        raise EncodeFailed(f"dtype {dtype} cannot be sent; use one of {list(_DTYPES)}")
    return name


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class ItemMeta:
    """What a receiver learns about one item besides its tensors.

    ``key`` is the 64-hex blake3 content key; ``grid_thw`` the patch grid;
    ``cache`` how the server obtained the output. Construction validates every
    field and raises ``SchemaError`` on a bad one.
    """

    key: str
    num_tokens: int
    grid_thw: tuple[int, int, int]
    cache: CacheState
    hidden_size: int
    dtype: str
    num_deepstack: int
    modality: str = "image"
    video: dict | None = None  # video items: VideoInfo's fields (api/schemas.py)
    tier: str | None = None  # hits only: device, host or shared

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not _KEY_RE.fullmatch(self.key):
            raise SchemaError(f"item key must be 64 lowercase hex chars, got {self.key!r}")
        for name in ("num_tokens", "hidden_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise SchemaError(f"item {name} must be a positive int, got {v!r}")
        if not _is_int(self.num_deepstack) or self.num_deepstack < 0:
            raise SchemaError(f"item num_deepstack must be an int >= 0, got {self.num_deepstack!r}")
        g = self.grid_thw
        if not isinstance(g, (tuple, list)) or len(g) != 3 or not all(_is_int(x) and x >= 1 for x in g):
            raise SchemaError(f"item grid_thw must be 3 positive ints, got {g!r}")
        object.__setattr__(self, "grid_thw", tuple(g))
        if self.cache not in _CACHE_STATES:
            raise SchemaError(f"item cache must be one of {_CACHE_STATES}, got {self.cache!r}")
        if self.tier is not None and (self.tier not in _TIERS or self.cache != "hit"):
            raise SchemaError(f"item tier must be one of {_TIERS}, on hits only, got {self.tier!r}")
        if self.dtype not in _DTYPES:
            raise SchemaError(f"item dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        if self.modality not in ("image", "video"):
            raise SchemaError(f"item modality must be image or video, got {self.modality!r}")
        if (self.video is not None) != (self.modality == "video"):
            raise SchemaError("a video item, and only a video item, carries video metadata")
        if self.video is not None:
            check_video_meta(self.video)

    @classmethod
    def describe(
        cls, output: ItemOutput, *, key: str, grid_thw: Sequence[int], cache: CacheState,
        video: dict | None = None, tier: str | None = None,
    ) -> ItemMeta:
        """The metadata that matches ``output``'s tensors."""
        emb = output.embedding
        if emb.dim() != 2:
            raise EncodeFailed(f"embedding must be [num_tokens, hidden], got {tuple(emb.shape)}")
        return cls(
            key=key,
            num_tokens=int(emb.shape[0]),
            grid_thw=cast("tuple[int, int, int]", tuple(grid_thw)),  # __post_init__ checks it
            cache=cache,
            hidden_size=int(emb.shape[1]),
            dtype=dtype_name(emb.dtype),
            num_deepstack=len(output.deepstack or ()),
            modality="image" if video is None else "video",
            video=video,
            tier=tier if cache == "hit" else None,
        )

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "num_tokens": self.num_tokens,
            "grid_thw": list(self.grid_thw),
            "cache": self.cache,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "num_deepstack": self.num_deepstack,
            "modality": self.modality,
            **({"video": self.video} if self.video is not None else {}),
            **({"tier": self.tier} if self.tier is not None else {}),
        }

    @classmethod
    def from_json(cls, d: Any) -> ItemMeta:
        """Parse one item object; unknown keys (``url``, say) are ignored."""
        if not isinstance(d, dict):
            raise SchemaError(f"item metadata must be an object, got {type(d).__name__}")
        missing = [f for f in _META_FIELDS if f not in d]
        if missing:
            raise SchemaError(f"item metadata lacks {missing}")
        return cls(**{f: d[f] for f in _META_FIELDS}, modality=d.get("modality", "image"),
                   video=d.get("video"), tier=d.get("tier"))


_META_FIELDS = ("key", "num_tokens", "grid_thw", "cache", "hidden_size", "dtype", "num_deepstack")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def check_video_meta(v: Any) -> None:
    """Video metadata as the server sends it: frame indices, source fps, and the
    family's timing (``second_per_grid_ts`` or per-temporal-patch ``timestamps``)."""
    if not isinstance(v, dict):
        raise SchemaError(f"item video metadata must be an object, got {type(v).__name__}")
    idx = v.get("frames_indices")
    if not isinstance(idx, list) or not idx or not all(_is_int(i) and i >= 0 for i in idx):
        raise SchemaError("video frames_indices must be a non-empty list of ints >= 0")
    if not _is_number(v.get("fps")) or v["fps"] < 0:
        raise SchemaError(f"video fps must be a number >= 0, got {v.get('fps')!r}")
    if v.get("second_per_grid_ts") is not None and not _is_number(v["second_per_grid_ts"]):
        raise SchemaError("video second_per_grid_ts must be a number")
    ts = v.get("timestamps")
    if ts is not None and (not isinstance(ts, list) or not all(_is_number(t) for t in ts)):
        raise SchemaError("video timestamps must be a list of numbers")


# -- packing -------------------------------------------------------------------


def host_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of ``t`` on the host (staging it there if needed)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data


def _check_output(meta: ItemMeta, output: ItemOutput, where: str) -> list[torch.Tensor]:
    tensors = [output.embedding, *(output.deepstack or ())]
    if len(tensors) - 1 != meta.num_deepstack:
        raise EncodeFailed(
            f"{where}: metadata says {meta.num_deepstack} deepstack tensors, output has {len(tensors) - 1}"
        )
    want_shape = (meta.num_tokens, meta.hidden_size)
    want_dtype = _torch_dtype(meta.dtype)
    for t in tensors:
        if tuple(t.shape) != want_shape or t.dtype != want_dtype:
            raise EncodeFailed(
                f"{where}: tensor {tuple(t.shape)} {t.dtype} disagrees with metadata "
                f"{want_shape} {want_dtype}"
            )
    return tensors


def _serialize(named: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    views: list[memoryview] = []
    offset = 0
    for name, t in named:
        view = host_bytes(t)
        header[name] = {
            "dtype": _DTYPES[dtype_name(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + view.nbytes],
        }
        offset += view.nbytes
        views.append(view)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # keeps the tensor data 8-byte aligned
    # One join: the only copy of the tensor bytes, straight into the body.
    return b"".join([struct.pack("<Q", len(head)), head, *views])


def pack_inline(
    items: Sequence[tuple[ItemMeta, ItemOutput]], *, model: str, request_id: str
) -> bytes:
    """The inline response body for ``items`` (in request order).

    Raises ``EncodeFailed`` if a meta disagrees with its tensors.
    """
    named: list[tuple[str, torch.Tensor]] = []
    for i, (meta, output) in enumerate(items):
        tensors = _check_output(meta, output, f"item {i}")
        named.append((f"item.{i}.embedding", tensors[0]))
        named.extend((f"item.{i}.deepstack.{j}", t) for j, t in enumerate(tensors[1:]))
    metadata = {
        "format": FORMAT,
        "model": str(model),
        "request_id": str(request_id),
        "items": json.dumps([meta.to_json() for meta, _ in items], separators=(",", ":")),
    }
    return _serialize(named, metadata)


def pack_item(meta: ItemMeta, output: ItemOutput, *, model: str) -> bytes:
    """The body of ``GET /v1/embeddings/{key}`` for one item."""
    tensors = _check_output(meta, output, "item")
    named = [("embedding", tensors[0])]
    named.extend((f"deepstack.{j}", t) for j, t in enumerate(tensors[1:]))
    metadata = {
        "format": FORMAT,
        "model": str(model),
        "item": json.dumps(meta.to_json(), separators=(",", ":")),
    }
    return _serialize(named, metadata)


# -- unpacking -----------------------------------------------------------------


def _read_metadata(body: bytes) -> dict[str, str]:
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise SchemaError(f"body must be bytes, got {type(body).__name__}")
    if len(body) < 8:
        raise SchemaError(f"body of {len(body)} bytes is too short for safetensors")
    (n,) = struct.unpack_from("<Q", body, 0)
    if n > min(_MAX_HEADER, len(body) - 8):
        raise SchemaError(f"safetensors header length {n} exceeds the body")
    try:
        header = json.loads(bytes(body[8 : 8 + n]))
    except (UnicodeDecodeError, ValueError) as e:
        raise SchemaError("safetensors header is not valid JSON") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise SchemaError("body has no __metadata__")
    if meta.get("format") != FORMAT:
        raise SchemaError(f"body format is {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _json_field(meta: dict[str, str], name: str) -> Any:
    raw = meta.get(name)
    if not isinstance(raw, str):
        raise SchemaError(f"__metadata__ lacks {name!r}")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise SchemaError(f"__metadata__[{name!r}] is not valid JSON") from e


def _str_field(meta: dict[str, str], name: str) -> str:
    v = meta.get(name)
    if not isinstance(v, str):
        raise SchemaError(f"__metadata__ lacks {name!r}")
    return v


def _load_tensors(body: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load as _st_load

    try:
        return _st_load(bytes(body) if not isinstance(body, bytes) else body)
    except (SafetensorError, ValueError, KeyError, RuntimeError) as e:
        raise SchemaError(f"body is not a valid safetensors file: {e}") from e


def _take_output(
    tensors: dict[str, torch.Tensor], meta: ItemMeta, prefix: str, where: str
) -> ItemOutput:
    names = [f"{prefix}embedding", *(f"{prefix}deepstack.{j}" for j in range(meta.num_deepstack))]
    want_shape = (meta.num_tokens, meta.hidden_size)
    want_dtype = _torch_dtype(meta.dtype)
    out = []
    for name in names:
        t = tensors.pop(name, None)
        if t is None:
            raise SchemaError(f"{where}: tensor {name!r} is missing")
        if tuple(t.shape) != want_shape or t.dtype != want_dtype:
            raise SchemaError(
                f"{where}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, "
                f"metadata says {want_shape} {want_dtype}"
            )
        out.append(t)
    return ItemOutput(out[0], tuple(out[1:]) if meta.num_deepstack else None)


def unpack_inline(body: bytes) -> tuple[dict, list[tuple[ItemMeta, ItemOutput]]]:
    """Parse an inline body into ``({"model", "request_id"}, [(meta, output), ...])``."""
    meta = _read_metadata(body)
    info = {"model": _str_field(meta, "model"), "request_id": _str_field(meta, "request_id")}
    raw_items = _json_field(meta, "items")
    if not isinstance(raw_items, list):
        raise SchemaError("__metadata__['items'] must be a JSON list")
    metas = [ItemMeta.from_json(d) for d in raw_items]
    tensors = _load_tensors(body)
    items = [
        (m, _take_output(tensors, m, f"item.{i}.", f"item {i}")) for i, m in enumerate(metas)
    ]
    if tensors:
        raise SchemaError(f"body has unexpected tensors {sorted(tensors)[:4]}")
    return info, items


def unpack_item(body: bytes) -> tuple[str, ItemMeta, ItemOutput]:
    """Parse a ``GET /v1/embeddings/{key}`` body into ``(model, meta, output)``."""
    meta = _read_metadata(body)
    model = _str_field(meta, "model")
    item = ItemMeta.from_json(_json_field(meta, "item"))
    tensors = _load_tensors(body)
    output = _take_output(tensors, item, "", "item")
    if tensors:
        raise SchemaError(f"body has unexpected tensors {sorted(tensors)[:4]}")
    return model, item, output
