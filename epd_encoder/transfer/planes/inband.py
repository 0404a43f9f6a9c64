# SPDX-License-Identifier: Apache-2.0
"""The ``zmq`` data planes: tensor bytes travel as raw ZeroMQ frames on the control channel.

Each tensor goes as a ``Data`` header and one frame sent with ``copy=False``
from the contiguous host tensor. The receiver copies each frame into its pool
region once. Only the receiver's I/O thread writes a region, and it refuses
frames for rooms that are not accepted, so a failed region cannot take a late
write: this plane needs no quarantine. One port carries everything (simplest
firewalling), at the cost of ZeroMQ's per-message receive buffer and copy;
the ``tcp`` plane (``transfer/planes/tcp.py``) is the fast path.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from epd_encoder.errors import ConfigError, EncodeFailed, InvalidInput
from epd_encoder.transfer.base import Region, host_bytes
from epd_encoder.transfer.messages import Data, encode
from epd_encoder.transfer.planes.pool import BufferPool


class ZmqReceiverPlane:
    name = "zmq"
    in_band = True  # bytes arrive as Data frames the control plane hands to write_frame

    def __init__(self, pool_bytes: int = 256 << 20, *, quarantine_s: float = 0.0,
                 pin_memory: bool = False) -> None:
        if pool_bytes <= 0:
            raise ConfigError(f"zmq pool_bytes must be positive, got {pool_bytes}")
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

    def settle(self, region: Region, chunks: Sequence[tuple[int, int]]) -> str:
        return ""  # the receiver checks each in-band frame against the layout itself

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


class ZmqSenderPlane:
    name = "zmq"

    def write(self, peer_info: dict[str, Any], dest: dict[str, Any],
              chunks: Sequence[tuple[int, torch.Tensor]], send_frames: Callable[[list], None]) -> None:
        room = dest.get("room")
        if not isinstance(room, str):
            raise EncodeFailed(f"zmq destination lacks the room: {dest!r}")
        for offset, tensor in chunks:
            if tensor.numel() == 0:
                continue  # nothing to place; the receiver expects no frame for it
            view = host_bytes(tensor)
            send_frames([encode(Data(room=room, offset=offset, nbytes=view.nbytes)), view])

    def close(self) -> None:
        pass
