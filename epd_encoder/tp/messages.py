# SPDX-License-Identifier: Apache-2.0
"""What rank 0 broadcasts to the other tensor-parallel ranks, and the batch digest.

Messages are tagged msgspec structs encoded as msgpack: typed, bounded and never
pickle (a rank executes nothing a message could smuggle in). Tensors never ride
in a message: a ``Work`` names the pixel shapes and dtype, and the pixels follow
as flat buffers by ``torch.distributed`` (broadcast or point to point, per mode).

The batch digest is blake3 over what defines a batch: request ids, item indices,
costs and grids, in batch order. Every rank computes it from its own view of the
batch and the ranks compare them (``wire.agree``) before any forward: a differing
batch is a typed, logged ``RankMismatch``, never a collective that hangs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Union

import blake3
import msgspec

from epd_encoder.errors import RankFailed

__all__ = ["Work", "Heartbeat", "Shutdown", "Message", "Add", "Cancel", "Take", "Call", "encode", "decode",
           "batch_digest", "DIGEST_BYTES", "MAX_MESSAGE_BYTES"]

DIGEST_BYTES = 32
# A message is metadata only (the pixels go separately): 64 MiB is far beyond any batch
# (64 items of a few hundred bytes each) and bounds what a corrupt length could allocate.
MAX_MESSAGE_BYTES = 64 << 20

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]
Grid = tuple[_Positive, _Positive, _Positive]


class Add(msgspec.Struct, frozen=True, tag="add", forbid_unknown_fields=True, array_like=True):
    """Rank 0's scheduler queued a unit (``tp/replica.py``): ``unit``, ``part``, ``cost``."""

    unit: str
    part: _Count
    cost: _Positive


class Cancel(msgspec.Struct, frozen=True, tag="cancel", forbid_unknown_fields=True, array_like=True):
    """Rank 0's scheduler dropped every pending part of ``unit``."""

    unit: str


class Take(msgspec.Struct, frozen=True, tag="take", forbid_unknown_fields=True, array_like=True):
    """Rank 0's scheduler formed a batch: each replica forms its own here."""


Call = Union[Add, Cancel, Take]


class Work(msgspec.Struct, frozen=True, tag="work", forbid_unknown_fields=True, omit_defaults=True):
    """One batch for the ranks. Fields are parallel lists in batch order.

    ``shapes``/``dtype`` describe each item's pixel tensor (which follows the message
    as a flat buffer); ``num_tokens`` each item's output rows. ``mode`` names the
    handler protocol that follows ("data": each rank gets its LPT share point to point).
    ``seq`` numbers batches from 1 on rank 0, so a log line names the same batch on
    every rank. ``calls`` are rank 0's scheduler calls since the last message, replayed
    by every rank before the digest (``tp/replica.py``); empty outside a server.
    """

    seq: _Positive
    mode: str
    request_ids: list[str]
    item_indices: list[_Count]
    costs: list[_Positive]
    grids: list[Grid]
    num_tokens: list[_Count]
    shapes: list[list[_Count]]
    dtype: str
    calls: list[Call] = []

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        lengths = {len(self.item_indices), len(self.costs), len(self.grids), len(self.num_tokens),
                   len(self.shapes)}
        if lengths != {n}:
            raise msgspec.ValidationError(f"work {self.seq}: field lengths differ ({n} request ids, {lengths})")

    def digest(self) -> bytes:
        return batch_digest(self.request_ids, self.item_indices, self.costs, self.grids)


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", forbid_unknown_fields=True, omit_defaults=True):
    """Rank 0 is alive and idle; sent at a low rate only when no work went out."""

    seq: _Count  # the last batch sent, so a rank can tell it missed none
    calls: list[Call] = []  # scheduler calls made while idle (cancels, a failed batch's Take)


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown", forbid_unknown_fields=True):
    """Leave the group and exit 0."""

    reason: str = ""


Message = Union[Work, Heartbeat, Shutdown]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """The message in ``data``; a malformed one is a ``RankFailed`` (the protocol broke)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise RankFailed(f"a rank message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise RankFailed(f"undecodable rank message: {e}") from e


def batch_digest(request_ids: Sequence[str], item_indices: Sequence[int], costs: Sequence[int],
                 grids: Sequence[Sequence[int]]) -> bytes:
    """blake3 of the batch's identity, length-prefixed field by field (no two batches
    share an encoding: an id cannot run into the next one)."""
    if not len(request_ids) == len(item_indices) == len(costs) == len(grids):
        raise ValueError("batch fields differ in length")
    h = blake3.blake3()
    h.update(len(request_ids).to_bytes(8, "little"))
    for rid, index, cost, grid in zip(request_ids, item_indices, costs, grids):
        raw = rid.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
        h.update(len(grid).to_bytes(8, "little"))
        for v in (index, cost, *grid):
            h.update(int(v).to_bytes(8, "little", signed=True))
    return h.digest(DIGEST_BYTES)
