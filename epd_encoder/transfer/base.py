# SPDX-License-Identifier: Apache-2.0
"""The data-plane interface of the push backends, and their lazy registry.

A push backend is a pair of data planes. The control plane (Offer, Accept,
Written, Ack, Complete over ZeroMQ; docs/protocol.md) is shared by every
backend and lives in ``transfer/control.py``; a backend only decides where a
room's bytes live on the receiver and how the sender puts them there.

Backends: ``tcp`` (a raw TCP data connection per sender/receiver pair, the
receiver ``recv_into``s the room's region; docs/transfer_tcp.md), ``zmq``
(bytes as frames on the control channel itself: one port, slower), ``shm``
(same host) and ``mooncake`` (optional dependency).

Receiver side (prefill): one ``ReceiverPlane`` per ``EmbeddingReceiver`` owns
a pre-allocated buffer (no per-request registration). A room gets a region of
it; the plane describes that region to the sender (``destination``), exposes
it as bytes for validation and tensor views (``view``), seals it when the
sender says it is written (``settle``) and takes it back (``free``). Regions
whose transfer failed are never handed out again while a late write could
still land in them (quarantine, or the plane refuses writes to freed regions).
An ``in_band`` plane gets its bytes from the control plane (``write_frame``);
a plane with ``listens = True`` is given the receiver's ``host`` and
``advertise_host`` because it serves its own data port. A sender plane with
``takes_timeout = True`` blocks on sockets and is given the sender's
``transfer_timeout`` as its ``timeout``.

Sender side (encode): one ``SenderPlane`` per encode server writes a room's
tensors into the destination an ``Accept`` named. ``write`` may block; the
caller runs it on the peer's own delivery thread, so a slow receiver never
stalls the tower or other peers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from epd_encoder.errors import ConfigError
from epd_encoder.wire import host_bytes  # noqa: F401  (re-exported for the planes)


@dataclass(frozen=True)
class Region:
    """A room's slice of a receiver buffer: ``nbytes`` at ``offset``."""

    offset: int
    nbytes: int


@runtime_checkable
class ReceiverPlane(Protocol):
    name: str
    in_band: bool  # bytes arrive as Data frames on the control channel (handed to write_frame)

    def info(self) -> dict[str, Any]:
        """Static, JSON-able facts a sender needs before any room (segment name, session id)."""
        ...

    def allocate(self, nbytes: int) -> Region:
        """A region of the pool; raises ``Overloaded`` when the pool cannot fit it now."""
        ...

    def destination(self, region: Region) -> dict[str, Any]:
        """What goes into ``Accept.dest`` for this region."""
        ...

    def write_frame(self, region: Region, offset: int, frame: memoryview) -> None:
        """In-band planes only: copy a received data frame into the region at ``offset``."""
        ...

    def settle(self, region: Region, chunks: Sequence[tuple[int, int]]) -> str:
        """The sender says the region is written: accept no later write; ``""`` or why the bytes are bad.

        ``chunks`` are the ``(offset, nbytes)`` of the non-empty tensors the
        layout expects. A plane that cannot tell (one-sided writes) returns ``""``.
        """
        ...

    def view(self, region: Region) -> torch.Tensor:
        """The region as a uint8 tensor (zero-copy where the memory allows)."""
        ...

    def free(self, region: Region, *, failed: bool = False) -> None:
        """Return the region; ``failed`` quarantines it."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class SenderPlane(Protocol):
    name: str

    def write(self, peer_info: dict[str, Any], dest: dict[str, Any],
              chunks: Sequence[tuple[int, torch.Tensor]], send_frames: Callable[[list], None]) -> None:
        """Put each ``(offset, tensor)`` of a room at ``dest``.

        ``peer_info`` is the receiver's ``info()``; ``send_frames`` sends raw
        frames on the room's control channel (the zmq plane uses it, the others
        write out of band). Returns only once every byte is in the receiver's
        region (or, for one-sided writes, the transfer engine says so). Raises
        on failure; the caller fails the room.
        """
        ...

    def close(self) -> None: ...


# name -> "module:attr" of (ReceiverPlane factory, SenderPlane factory); imported on first use,
# so an optional backend's dependency (mooncake) is only needed when it is chosen.
_BACKENDS: dict[str, tuple[str, str]] = {
    "tcp": ("epd_encoder.transfer.planes.tcp:TcpReceiverPlane", "epd_encoder.transfer.planes.tcp_sender:TcpSenderPlane"),
    "zmq": ("epd_encoder.transfer.planes.inband:ZmqReceiverPlane", "epd_encoder.transfer.planes.inband:ZmqSenderPlane"),
    "shm": ("epd_encoder.transfer.planes.shm:ShmReceiverPlane", "epd_encoder.transfer.planes.shm:ShmSenderPlane"),
    "mooncake": ("epd_encoder.transfer.planes.mooncake:MooncakeReceiverPlane",
                 "epd_encoder.transfer.planes.mooncake:MooncakeSenderPlane"),
    "nixl": ("epd_encoder.transfer.planes.nixl:NixlReceiverPlane", "epd_encoder.transfer.planes.nixl:NixlSenderPlane"),
}


def backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def receiver_plane_factory(name: str) -> Callable[..., ReceiverPlane]:
    return _load(_entry(name)[0])


def receiver_plane(name: str, **options: Any) -> ReceiverPlane:
    return receiver_plane_factory(name)(**options)


def sender_plane_factory(name: str) -> Callable[..., SenderPlane]:
    return _load(_entry(name)[1])


def sender_plane(name: str, **options: Any) -> SenderPlane:
    return sender_plane_factory(name)(**options)


def _entry(name: str) -> tuple[str, str]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown transfer backend {name!r}; choose one of {', '.join(_BACKENDS)}") from None
