# SPDX-License-Identifier: Apache-2.0
"""The group's wire, both sides: rank 0's messages by broadcast, the digest all-gather, and
one flat broadcast of pixels.

A message goes out as one broadcast of a fixed ``HEADER_BYTES`` block (8-byte length plus
the start of the body); a longer one sends the rest in a second broadcast. A heartbeat or a
64-item batch fits in the first, so an idle group costs one small collective per heartbeat.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epd_encoder.errors import RankFailed, RankMismatch
from epd_encoder.tp.messages import DIGEST_BYTES, MAX_MESSAGE_BYTES, Message, decode, encode

__all__ = ["send_message", "receive_message", "agree", "broadcast_flat", "HEADER_BYTES"]

HEADER_BYTES = 4096

def send_message(msg: Message) -> None:
    data = encode(msg)
    if len(data) > MAX_MESSAGE_BYTES:
        raise RankFailed(f"a rank message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    head = bytearray(HEADER_BYTES)
    head[:8] = len(data).to_bytes(8, "little")
    first = data[:HEADER_BYTES - 8]
    head[8:8 + len(first)] = first
    dist.broadcast(torch.frombuffer(head, dtype=torch.uint8), src=0)
    if len(data) > len(first):
        dist.broadcast(torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8), src=0)


def receive_message() -> Message:
    head = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    dist.broadcast(head, src=0)
    raw = head.numpy().tobytes()
    n = int.from_bytes(raw[:8], "little")
    if n > MAX_MESSAGE_BYTES:
        raise RankFailed(f"rank 0 announced a message of {n} bytes")
    body = raw[8:8 + n]
    if n > len(body):
        rest = torch.empty(n - len(body), dtype=torch.uint8)
        dist.broadcast(rest, src=0)
        body += rest.numpy().tobytes()
    return decode(body)


def agree(digest: bytes, seq: int) -> None:
    """All-gather every rank's batch digest; any difference is a ``RankMismatch`` on every rank."""
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"a digest is {DIGEST_BYTES} bytes, got {len(digest)}")
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    views = [torch.empty(DIGEST_BYTES, dtype=torch.uint8) for _ in range(dist.get_world_size())]
    dist.all_gather(views, mine)
    seen = [v.numpy().tobytes() for v in views]
    if len(set(seen)) > 1:
        detail = ", ".join(f"rank {r}: {d.hex()[:16]}" for r, d in enumerate(seen))
        raise RankMismatch(f"batch {seq}: the ranks formed different batches ({detail})")


def broadcast_flat(tensors: list[torch.Tensor] | None, shapes: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank gets every tensor: rank 0 passes them, the others ``None``; one broadcast
    of one flat buffer (the hook weights mode uses for the pixels: each rank needs all)."""
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    if tensors is not None:
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors]) if tensors else torch.empty(0, dtype=dtype)
    else:
        flat = torch.empty(sum(sizes), dtype=dtype)
    if flat.numel():
        dist.broadcast(flat, src=0)
    return [p.view(s) for p, s in zip(flat.split(sizes), shapes)]

