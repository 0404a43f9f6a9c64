# SPDX-License-Identifier: Apache-2.0
"""Error bodies are bounded whatever the message: echoed client values never come back at length."""

from __future__ import annotations

import pytest

from epd_encoder import errors as E
from epd_encoder.api.errors import MAX_MESSAGE_CHARS, error_response
from epd_encoder.api.schemas import EncodeBody
from epd_encoder.transfer.control import check_delivery


@pytest.mark.parametrize("message", ["x" * 10_000_000, "\x00" * 100_000, "😀" * 100_000])
def test_any_message_is_cut_to_well_under_4_kib(message):
    r = error_response(E.UnsupportedMedia(message))
    assert r.status_code == 415 and len(r.body) < 4096
    assert len(message) > MAX_MESSAGE_CHARS and r.body.decode().endswith('…"}}')


def test_a_short_message_is_untouched():
    assert b'"message":"plain words"' in error_response(E.NotFound("plain words")).body


@pytest.mark.parametrize("value", ["k" * 1_000_000, b"k" * 1_000_000, ["k" * 1000] * 1000, None, 17])
def test_clip_is_short_and_keeps_the_start(value):
    text = E.clip(value)
    assert len(text) < 80 and text[:3] == repr(value)[:3]


def test_messages_that_echo_client_values_are_built_short():
    with pytest.raises(E.UnsupportedMedia) as e:
        EncodeBody(items=[{"type": "v" * 1_000_000}]).sources()
    assert len(e.value.message) < 200 and "vvvv" in e.value.message
    for bad in ({"mode": "m" * 1_000_000}, {"mode": "push", "backend": "b" * 1_000_000}):
        with pytest.raises(ValueError) as e:
            check_delivery(bad)
        assert len(str(e.value)) < 300
