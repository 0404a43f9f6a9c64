# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the shm tests (``nothing_left_behind`` is opted into per module)."""

from __future__ import annotations

import gc

import pytest

from epd_encoder.transfer.planes.shm import ShmReceiverPlane, ShmSenderPlane
from tests.transfer.shm_helpers import PIDS, ours


@pytest.fixture(scope="module")
def nothing_left_behind():
    yield
    gc.collect()
    left = [p for pid in PIDS for p in ours(pid)]
    assert not left, f"leaked shm segments: {left}"


@pytest.fixture
def rx():
    plane = ShmReceiverPlane(pool_bytes=1 << 20)
    yield plane
    plane.close()


@pytest.fixture
def tx():
    plane = ShmSenderPlane()
    yield plane
    plane.close()
