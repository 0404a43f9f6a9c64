# SPDX-License-Identifier: Apache-2.0
"""Unit tests of the front's pieces (the request path itself is tested end to end)."""

from __future__ import annotations

import base64
import gc
import weakref

import pytest
import torch

from epd_encoder.api.metrics import Metrics
from epd_encoder.engine.cache import EmbeddingCache
from epd_encoder.engine.worker import ItemResult, Outcome
from epd_encoder.errors import ImageTooLarge, InvalidBase64, RequestTimeout
from epd_encoder.server.front import _b64, _Pins, _PushSink
from epd_encoder.types import ItemOutput


class Room:
    def __init__(self):
        self.delivered, self.failed, self.release = None, None, None

    def deliver(self, outputs, release):
        self.delivered, self.release = outputs, release

    def fail(self, error):
        self.failed = error


def result(i, tensor, released):
    return ItemResult("r", i, bytes([i]) * 32, ItemOutput(tensor), "miss", lambda: released.append(i))


def test_push_sink_hands_outputs_over_and_keeps_none():
    room, released = Room(), []
    cache = EmbeddingCache(capacity_bytes=1 << 20)
    cache.put(b"k" * 32, "v", 1)
    pins = _Pins(cache)
    assert pins.take(b"k" * 32) and not pins.take(b"x" * 32)
    sink = _PushSink(room, Metrics(), pins)
    t = torch.ones(2, 4)
    alive = weakref.ref(t)
    sink.on_item(result(1, t, released))
    sink.on_item(result(0, torch.zeros(2, 4), released))
    del t
    sink.on_finish(Outcome("r", "done"))
    assert sink.items == [] and cache.pin_count(b"k" * 32) == 0
    assert [o.embedding.sum().item() for o in room.delivered] == [0.0, 8.0]  # item order
    room.release()
    assert sorted(released) == [0, 1]
    room.delivered = room.release = None
    gc.collect()
    assert alive() is None  # nothing in the front still holds the output


def test_push_sink_failure_releases_and_fails_the_room():
    room, released = Room(), []
    sink = _PushSink(room, Metrics(), _Pins(EmbeddingCache(capacity_bytes=1024)))
    sink.on_item(result(0, torch.zeros(1, 1), released))
    sink.on_finish(Outcome("r", "failed", RequestTimeout("late")))
    assert isinstance(room.failed, RequestTimeout) and released == [0] and sink.items == []


def test_b64_forms_and_limits():
    raw = b"\x89PNG....."
    enc = base64.b64encode(raw).decode()
    assert _b64(enc, 100) == raw and _b64(f"data:image/png;base64,{enc}", 100) == raw
    with pytest.raises(InvalidBase64):
        _b64("data:image/png,notbase64", 100)
    with pytest.raises(InvalidBase64):
        _b64("!!!!", 100)
    with pytest.raises(ImageTooLarge):
        _b64("A" * 200, 100)  # refused before decoding
