# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest
import torch

from epd_encoder.errors import EncodeFailed
from epd_encoder.transfer.planes.staging import check_span, host_buffer, segments


def t(n):
    return torch.zeros(n, dtype=torch.uint8)


def test_segments_bridge_padding_only():
    chunks = [(0, t(100)), (128, t(64)), (192, t(10)), (1000, t(8)), (1008, t(8))]
    assert segments(chunks) == [(0, 202), (1000, 16)]
    assert segments([(64, t(64)), (64, t(32))]) == [(64, 64)]


def test_check_span_refuses_anything_outside_the_buffer():
    check_span(0x1000, 16, 0x1000, 16)
    for addr, span in ((0xFFF, 16), (0x1000, 17), (0x1001, 16), (0x1000, -1)):
        with pytest.raises(EncodeFailed):
            check_span(addr, span, 0x1000, 16)


def test_host_buffer_unpinned_without_cuda():
    buf = host_buffer(128, pin_memory=False)
    assert buf.dtype == torch.uint8 and buf.numel() == 128 and not buf.is_pinned()
