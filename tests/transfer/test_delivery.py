# SPDX-License-Identifier: Apache-2.0
"""One validator for the push delivery: what ``EmbeddingReceiver.delivery()`` hands out, the server takes."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_encoder.api.schemas import EncodeBody
from epd_encoder.errors import NotFound
from epd_encoder.receiver import EmbeddingReceiver
from epd_encoder.transfer.control import parse_delivery
from epd_encoder.transfer.policy import endpoint_host


def server_takes(delivery: dict) -> str:
    """What the server does with a push delivery (schema, then the sender's parse); the room it uses."""
    wire = json.dumps({"items": [{"type": "image", "image": "AA=="}], "delivery": delivery}, allow_nan=False)
    body = EncodeBody.model_validate_json(wire)
    d = parse_delivery(body.delivery.model_dump())
    for t in d.targets:
        endpoint_host(t.endpoint)
    return d.room


@pytest.fixture(scope="module")
def rx():
    with EmbeddingReceiver("zmq", pool_bytes=4 << 10) as r:
        yield r


@pytest.mark.parametrize("room", ["room 1", "tenant/room-1", "r" * 200, "", "é", 1.5, None, True, b"room"])
def test_delivery_refuses_at_once_what_the_server_would_refuse(rx, room):
    with pytest.raises((ValueError, TypeError)):
        rx.delivery(room)
    if isinstance(room, str):
        with pytest.raises(NotFound):  # nothing was registered
            rx.poll(room)
    assert rx.ready_rooms() == []


@pytest.mark.parametrize("room", [0, 17, -5, 2**63 - 1, 2**64])
def test_an_int_room_is_its_decimal_string(rx, room):
    d = rx.delivery(room)
    assert d["room"] == str(room) and server_takes(d) == str(room)
    assert rx.poll(room) == rx.poll(str(room)) == "pending"
    rx.discard(room)
    with pytest.raises(NotFound):
        rx.poll(str(room))


def test_the_server_takes_a_json_int_room(rx):
    d = rx.delivery("placeholder")
    rx.discard("placeholder")
    assert server_takes({**d, "room": 2**63 - 1}) == str(2**63 - 1)
    with pytest.raises(ValueError):
        server_takes({**d, "room": True})


@pytest.mark.parametrize("timeout", [900, 600.5, 0, -1, math.nan, math.inf, True, "10"])
def test_a_bootstrap_timeout_the_server_refuses_is_refused_by_the_receiver(timeout):
    with pytest.raises((ValueError, TypeError)):
        EmbeddingReceiver("zmq", pool_bytes=4 << 10, bootstrap_timeout=timeout).close()


@settings(max_examples=300, deadline=None)
@given(room=st.one_of(st.integers(), st.text(), st.from_regex(r"[A-Za-z0-9._:\-]{1,140}", fullmatch=True),
                      st.floats(), st.binary(max_size=4), st.none(), st.booleans()))
def test_whatever_delivery_accepts_the_server_accepts(rx, room):
    try:
        d = rx.delivery(room)
    except (ValueError, TypeError):
        assert rx.ready_rooms() == []
        return
    try:
        assert server_takes(d) == d["room"] == str(room)
    finally:
        rx.discard(room)


@settings(max_examples=40, deadline=None)
@given(timeout=st.one_of(st.floats(), st.integers(-10, 2000), st.booleans()))
def test_whatever_bootstrap_timeout_a_receiver_takes_the_server_takes(timeout):
    try:
        r = EmbeddingReceiver("zmq", pool_bytes=4 << 10, bootstrap_timeout=timeout)
    except (ValueError, TypeError):
        return
    with r:
        server_takes(r.delivery("r"))
