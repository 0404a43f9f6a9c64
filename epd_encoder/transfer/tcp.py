# SPDX-License-Identifier: Apache-2.0
"""The tcp data planes: tensor bytes travel as raw ZeroMQ frames on the control channel.

Each tensor goes as a ``Data`` header and one frame sent with ``copy=False``
from the contiguous host tensor. The receiver copies each frame into its pool
region once. Only the receiver's I/O thread writes a region, and it refuses
frames for rooms that are not accepted, so a failed region cannot take a late
write: tcp needs no quarantine.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from epd_encoder.errors import ConfigError, EncodeFailed, InvalidInput
from epd_encoder.transfer.base import Region
from epd_encoder.transfer.messages import Data, encode
from epd_encoder.transfer.pool import BufferPool


class TcpReceiverPlane:
    name = "tcp"
    in_band = True  # bytes arrive as Data frames the control plane hands to write_frame

    def __init__(self, pool_bytes: int = 256 << 20, *, quarantine_s: float = 0.0,
                 pin_memory: bool = False) -> None:
        if pool_bytes <= 0:
            raise ConfigError(f"tcp pool_bytes must be positive, got {pool_bytes}")
        self._buf = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._np = self._buf.numpy()
        self._pool = BufferPool(pool_bytes, quarantine_s=quarantine_s)
        self.capacity = self._pool.capacity

    def info(self) -> dict[str, Any]:
        return {"pool_bytes": self.capacity}

    def allocate(self, nbytes: int) -> Region:
        return self._pool.allocate(nbytes)

    def destination(self, region: Region) -> dict[str, Any]:
        return {"offset": region.offset, "nbytes": region.nbytes}

    def write_frame(self, region: Region, offset: int, frame: memoryview) -> None:
        data = np.frombuffer(frame, dtype=np.uint8)
        if offset < 0 or offset + data.size > region.nbytes:
            raise InvalidInput(f"{data.size} B at {offset} overflow region {region}")
        start = region.offset + offset
        self._np[start:start + data.size] = data

    def view(self, region: Region) -> torch.Tensor:
        return self._buf[region.offset:region.offset + region.nbytes]

    def free(self, region: Region, *, failed: bool = False) -> None:
        self._pool.free(region, failed=failed)

    def close(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._np = self._buf.numpy()

    @property
    def pool(self) -> BufferPool:
        return self._pool


def host_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of ``t`` on the host: zero-copy for a contiguous CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class TcpSenderPlane:
    name = "tcp"

    def __init__(self) -> None:
        pass

    def write(self, peer_info: dict[str, Any], dest: dict[str, Any],
              chunks: Sequence[tuple[int, torch.Tensor]], send_frames: Callable[[list], None]) -> None:
        room = dest.get("room")
        if not isinstance(room, str):
            raise EncodeFailed(f"tcp destination lacks the room: {dest!r}")
        for offset, tensor in chunks:
            if tensor.numel() == 0:
                continue  # nothing to place; the receiver expects no frame for it
            view = host_bytes(tensor)
            send_frames([encode(Data(room=room, offset=offset, nbytes=view.nbytes)), view])

    def close(self) -> None:
        pass
