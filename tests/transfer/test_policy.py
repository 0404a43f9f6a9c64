# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

from epd_encoder.errors import InvalidInput
from epd_encoder.transfer.control import Delivery, Target
from epd_encoder.transfer.policy import TargetPolicy, endpoint_host


def delivery(*targets):
    return Delivery("tcp", "room", tuple(Target(ep, i, info) for i, (ep, info) in enumerate(targets)), None)


def test_endpoint_host():
    assert endpoint_host("tcp://10.1.2.3:5555") == "10.1.2.3"
    assert endpoint_host("tcp://[fd00::1]:5555") == "fd00::1"
    assert endpoint_host("ipc:///tmp/rx.sock") == "ipc"
    with pytest.raises(InvalidInput):
        endpoint_host("udp://x:1")


def test_default_allows_any_and_an_allowlist_restricts():
    assert TargetPolicy(None).allows("203.0.113.9")
    p = TargetPolicy(["10.0.0.0/8", "prefill-0.svc", "ipc"])
    assert p.allows("10.9.8.7") and p.allows("PREFILL-0.svc") and p.allows("ipc")
    assert not p.allows("127.0.0.1") and not p.allows("169.254.169.254") and not p.allows("prefill-1.svc")


def test_data_host_must_be_allowed_too():
    p = TargetPolicy(["10.0.0.0/8"])
    p.check(delivery(("tcp://10.0.0.5:1", {"data_host": "10.0.0.5", "data_port": 2})))
    with pytest.raises(InvalidInput, match="169.254.169.254"):
        p.check(delivery(("tcp://10.0.0.5:1", {"data_host": "169.254.169.254", "data_port": 80})))
    with pytest.raises(InvalidInput, match="127.0.0.1"):
        p.check(delivery(("tcp://10.0.0.5:1", {}), ("tcp://127.0.0.1:1", {})))
