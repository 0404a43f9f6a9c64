# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the registered-memory planes (Mooncake, NIXL)."""

from __future__ import annotations

import torch

from epd_encoder.errors import ConfigError, EncodeFailed
from epd_encoder.transfer.messages import ALIGN


def host_buffer(nbytes: int, pin_memory: bool | None) -> torch.Tensor:
    """A uint8 host buffer, pinned by default only where CUDA can use it."""
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    except RuntimeError as e:
        raise ConfigError(f"cannot allocate a {nbytes}-byte {'pinned ' if pin else ''}host buffer") from e


def segments(flat: list[tuple[int, torch.Tensor]]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` spans covering sorted chunks; gaps shorter than ALIGN (padding) are bridged."""
    spans = [[flat[0][0], flat[0][0] + flat[0][1].numel()]]
    for off, b in flat[1:]:
        if off - spans[-1][1] < ALIGN:
            spans[-1][1] = max(spans[-1][1], off + b.numel())
        else:
            spans.append([off, off + b.numel()])
    return [(a, e - a) for a, e in spans]


def check_span(addr: int, span: int, base: int, size: int) -> None:
    """A destination must lie inside the buffer its peer announced: never an oversized write."""
    if span < 0 or addr < base or addr + span > base + size:
        raise EncodeFailed(f"destination [{addr:#x}, +{span}) lies outside the peer's buffer "
                           f"[{base:#x}, +{size})")
