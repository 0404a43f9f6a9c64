# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

from epd_encoder.errors import NotReady
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.server.runtime import Runtime
from tests.e2e.harness import serve_config


def test_no_push_sender_is_made_after_stop(tmp_path):
    """A request that passed the ready check just before stop() must not start a
    sender that nothing would ever close."""
    rt = Runtime(serve_config(write_tiny_model("qwen2_vl", tmp_path / "m")))
    rt.start()
    rt.stop()
    with pytest.raises(NotReady):
        rt.push


def test_stop_closes_the_sender_it_made(tmp_path):
    rt = Runtime(serve_config(write_tiny_model("qwen2_vl", tmp_path / "m")))
    rt.start()
    sender = rt.push
    rt.stop()
    assert rt.push is sender  # the closed sender refuses rooms itself
    with pytest.raises(NotReady, match="closed"):
        sender.open({"mode": "push", "backend": "tcp", "room": "r",
                     "targets": [{"endpoint": "tcp://127.0.0.1:1"}]}, "rid", [])
