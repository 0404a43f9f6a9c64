# SPDX-License-Identifier: Apache-2.0
"""Wire messages of the push protocol (docs/protocol.md), as tagged msgspec structs.

Control messages travel over one ZeroMQ channel per (sender, receiver) pair,
msgpack-encoded. Tensor bytes never travel pickled: the zmq data plane sends
them as raw frames after a ``Data`` header; tcp (its own data connections),
shm and Mooncake write them straight into the receiver's buffer at the
offsets ``layout`` gives.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

ALIGN = 64  # every tensor starts on a 64-byte boundary inside a room's region

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]


class VideoWire(msgspec.Struct, frozen=True):
    """A video item's timing, as in the encode answer (api/schemas.py VideoInfo)."""

    frames_indices: tuple[_Count, ...]
    fps: Annotated[float, msgspec.Meta(ge=0)]
    total_num_frames: _Count | None = None
    second_per_grid_ts: float | None = None
    timestamps: tuple[float, ...] | None = None


class WireItem(msgspec.Struct, frozen=True):
    """One item as both sides size it: the tensors are the embedding, then deepstack."""

    key: str
    num_tokens: _Count
    grid_thw: tuple[_Count, _Count, _Count]
    hidden_size: _Positive
    dtype: Literal["float32", "bfloat16", "float16"]
    num_deepstack: _Count = 0
    modality: Literal["image", "video"] = "image"
    video: VideoWire | None = None


class Offer(msgspec.Struct, tag="offer", frozen=True):
    """Sender → receiver: the room's items are encoded; where should they go?"""

    room: str
    request_id: str
    sender: str
    items: tuple[WireItem, ...]
    total_bytes: _Count


class Accept(msgspec.Struct, tag="accept", frozen=True):
    """Receiver → sender: write to ``dest`` (backend-specific: segment and offset, address...)."""

    room: str
    dest: dict[str, Any]


class Reject(msgspec.Struct, tag="reject", frozen=True):
    """Receiver → sender: this room cannot be taken (unknown, full, mismatched); nothing is written."""

    room: str
    reason: str
    code: str = ""  # an EncoderError code, so every rank fails with the same typed error


class Data(msgspec.Struct, tag="data", frozen=True):
    """zmq data plane only: the next frame holds ``nbytes`` bytes at ``offset`` of the room."""

    room: str
    offset: _Count
    nbytes: _Count


class Written(msgspec.Struct, tag="written", frozen=True):
    """Sender → receiver: every byte of the room is in place; validate it."""

    room: str
    total_bytes: _Count


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """Receiver → sender: the room's bytes were validated (``ok``) or not."""

    room: str
    ok: bool
    reason: str = ""
    code: str = ""


class Complete(msgspec.Struct, tag="complete", frozen=True):
    """Sender → every receiver of the room: the one final outcome all ranks agree on."""

    room: str
    ok: bool
    code: str = ""
    reason: str = ""


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Receiver → sender: the receiver gave up on the room (timeout, close); free it."""

    room: str
    reason: str


Message = Union[Offer, Accept, Reject, Data, Written, Ack, Complete, Abort]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes | memoryview) -> Message:
    """Raises ``msgspec.ValidationError`` / ``DecodeError`` on a malformed frame."""
    return _decoder.decode(frame)


_ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def item_tensor_bytes(item: WireItem) -> int:
    """Bytes of one of the item's tensors (all are ``[num_tokens, hidden_size]``)."""
    return item.num_tokens * item.hidden_size * _ELEMENT_SIZE[item.dtype]


def layout(items: tuple[WireItem, ...] | list[WireItem]) -> tuple[list[list[tuple[int, int]]], int]:
    """``(offsets, total)``: per item, ``(offset, nbytes)`` of each tensor; total region size.

    Both sides compute it from the offered metadata alone, so the receiver can
    allocate and validate before a byte arrives.
    """
    offsets: list[list[tuple[int, int]]] = []
    pos = 0
    for item in items:
        n = item_tensor_bytes(item)
        per = []
        for _ in range(1 + item.num_deepstack):
            per.append((pos, n))
            pos += (n + ALIGN - 1) // ALIGN * ALIGN
        offsets.append(per)
    return offsets, pos
