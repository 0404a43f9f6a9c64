# SPDX-License-Identifier: Apache-2.0
"""No slash redirects: a client's Host header is never reflected into a Location."""

from __future__ import annotations

import pytest

from tests.e2e.hostile import connect, read_until_closed, status_of


@pytest.mark.parametrize("path", ["/v1/embeddings/abc/", "/health/", "/v1/models/"])
def test_a_trailing_slash_is_404_without_a_location(server, path):
    s = connect(server.url)
    try:
        s.sendall(b"GET %s HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n" % path.encode())
        data, _ = read_until_closed(s, timeout=10)
    finally:
        s.close()
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    assert status_of(data) == 404, data[:300]
    assert b"location:" not in head and b"evil.example" not in data
