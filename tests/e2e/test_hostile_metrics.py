# SPDX-License-Identifier: Apache-2.0
"""A client that hangs up mid-body is a client disconnect (499), never a server fault (500)."""

from __future__ import annotations

import httpx

from tests.e2e.harness import delta, scrape, wait_for
from tests.e2e.hostile import HealthProbe, connect

LABELS = dict(route="unmatched")  # the body is read before routing


def test_a_hangup_mid_body_counts_499_not_500(server):
    with httpx.Client(base_url=server.url, timeout=10) as c, HealthProbe(server.url) as probe:
        before = scrape(c)
        for _ in range(3):
            s = connect(server.url)
            s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n" + b"{" * 1000)
            s.close()

        def counted() -> bool:
            now = scrape(c)
            return sum(v - before.get(k, 0.0) for k, v in now.items()
                       if k[0] == "epd_requests_total" and dict(k[1]).get("route") == "unmatched") >= 3

        assert wait_for(counted, timeout=10)
        assert delta(c, before, "epd_requests_total", status="499", **LABELS) == 3
        after = scrape(c)
        assert not any(k[0] == "epd_requests_total" and dict(k[1]).get("status", "").startswith("5")
                       and v > before.get(k, 0.0) for k, v in after.items()), after
    probe.check(name="mid-body hangups")
