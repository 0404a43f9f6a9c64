# SPDX-License-Identifier: Apache-2.0
"""The shared tier's entries: two objects per content key.

- ``<namespace>@id:<key>``: vLLM 0.32's Mooncake embedding object as is (``<IIQQ`` header of
  magic, dtype code, tokens, width, then the rows of ``ItemOutput.joined()``), so a vLLM
  consumer with ``cross_encoder_cache`` reads it by the proxy's uuid (our content key).
- ``<namespace>@epd-meta:v1@id:<key>``: our versioned sidecar (msgspec JSON): what the header
  cannot carry (grid, modality, video timing, the deepstack split) and a blake3 of the object.

The sidecar is a separate key, not a trailer: vLLM reads exactly header + rows bytes with
``batch_get_into`` and Mooncake refuses a buffer smaller than the object (-600), so a trailer
would make every vLLM read of our entries a miss (docs/cache.md, "Value format").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import msgspec
from blake3 import blake3

from epd_encoder.transfer.ec.mooncake_store import DTYPE_CODES, HEADER, MAGIC, embedding_key

if TYPE_CHECKING:
    import torch

    from epd_encoder.types import ItemOutput

VERSION = 1
MAX_META_BYTES = 64 << 10  # a sidecar is a few hundred bytes; a long video's frame list a few KiB


class CorruptEntry(ValueError):
    """An entry that fails validation: a miss, counted, never served."""


class EntryMeta(msgspec.Struct, frozen=True):
    """The sidecar, version 1. Readers refuse other versions (a miss, not a crash)."""

    v: int
    key: str
    modality: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    hidden_size: int
    num_deepstack: int
    dtype: str
    nbytes: int  # the vLLM object's length, header included
    blake3: str  # hex digest of the vLLM object
    video: dict | None = None


def value_key(namespace: str, key: str) -> str:
    return embedding_key(namespace, key)


def meta_key(namespace: str, key: str) -> str:
    return f"{namespace}@epd-meta:v{VERSION}@id:{key}"


class Entry(NamedTuple):
    """One item to write: the vLLM object as (header, rows' bytes), and the sidecar."""

    header: bytes
    body: memoryview  # a view of the host rows: no copy under the GIL (a 32 MiB one held it ~40 ms)
    meta: bytes

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.body.nbytes


def encode_entry(key: str, output: ItemOutput, *, grid_thw: tuple[int, int, int], modality: str,
                 video: dict | None) -> Entry:
    """The entry for ``output`` (copied to the host here, if it is not there)."""
    import torch

    rows = output.joined().detach().to("cpu").contiguous()
    dtype = str(rows.dtype).removeprefix("torch.")
    if dtype not in DTYPE_CODES or rows.dim() != 2:
        raise ValueError(f"the shared tier stores 2-D {sorted(DTYPE_CODES)} rows, got {dtype} {tuple(rows.shape)}")
    header = HEADER.pack(MAGIC, DTYPE_CODES[dtype], *rows.shape)
    body = rows.view(-1).view(torch.uint8).numpy().data
    digest = blake3(header)
    digest.update(body)
    meta = EntryMeta(v=VERSION, key=key, modality=modality, grid_thw=tuple(grid_thw),  # type: ignore[arg-type]
                     num_tokens=int(rows.shape[0]), hidden_size=int(output.embedding.shape[1]),
                     num_deepstack=len(output.deepstack or ()), dtype=dtype, nbytes=len(header) + body.nbytes,
                     blake3=digest.hexdigest(), video=video)
    return Entry(header, body, msgspec.json.encode(meta))


def decode_meta(key: str, raw: bytes | memoryview) -> EntryMeta:
    try:
        meta = msgspec.json.decode(raw, type=EntryMeta)
    except msgspec.DecodeError as e:
        raise CorruptEntry(f"sidecar: {e}") from e
    if meta.v != VERSION:
        raise CorruptEntry(f"sidecar version {meta.v}, this server reads {VERSION}")
    if meta.key != key:
        raise CorruptEntry("sidecar names another key")
    width = meta.hidden_size * (1 + meta.num_deepstack)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(meta.dtype)
    if (itemsize is None or meta.hidden_size < 1 or meta.num_deepstack < 0 or meta.num_tokens < 1
            or meta.nbytes != HEADER.size + meta.num_tokens * width * itemsize):
        raise CorruptEntry("sidecar sizes disagree")
    return meta


def decode_value(meta: EntryMeta, value: torch.Tensor, *, grid_thw: tuple[int, int, int],
                 num_tokens: int) -> ItemOutput:
    """The item from its vLLM object (a uint8 host tensor), checked against the sidecar and
    against what this server computed for the key (grid and tokens, from the image's header)."""
    import torch

    from epd_encoder.types import ItemOutput

    if tuple(meta.grid_thw) != tuple(grid_thw) or meta.num_tokens != num_tokens:
        raise CorruptEntry(f"entry is {meta.grid_thw}/{meta.num_tokens} tokens, the item {grid_thw}/{num_tokens}")
    if value.numel() != meta.nbytes:
        raise CorruptEntry(f"object is {value.numel()} bytes, the sidecar says {meta.nbytes}")
    raw = value.numpy()
    if blake3(raw.data).hexdigest() != meta.blake3:
        raise CorruptEntry("checksum mismatch")
    magic, code, tokens, width = HEADER.unpack(raw[:HEADER.size].tobytes())
    if (magic, code, tokens, width) != (MAGIC, DTYPE_CODES[meta.dtype], meta.num_tokens,
                                        meta.hidden_size * (1 + meta.num_deepstack)):
        raise CorruptEntry("header disagrees with the sidecar")
    rows = value[HEADER.size:].view(getattr(torch, meta.dtype)).view(tokens, width)
    h = meta.hidden_size
    if not meta.num_deepstack:
        return ItemOutput(rows)
    parts = [rows[:, i * h:(i + 1) * h].contiguous() for i in range(1 + meta.num_deepstack)]
    return ItemOutput(parts[0], tuple(parts[1:]))
