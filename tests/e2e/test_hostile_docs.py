# SPDX-License-Identifier: Apache-2.0
"""The API docs are behind the key like every other route, unless --public-docs opens them."""

from __future__ import annotations

import httpx
import pytest

from epd_encoder.cli import build_parser
from epd_encoder.config import AuthConfig, ServeConfig, from_namespace
from tests.e2e.harness import Server, serve_config
from tests.e2e.hostile import AUTH, KEY

DOCS = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")


@pytest.mark.parametrize("path", DOCS)
def test_docs_need_the_key(locked, path):
    with httpx.Client(base_url=locked.url, timeout=10) as c:
        assert c.get(path).status_code == 401
        assert c.get(path, headers=AUTH).status_code == 200


def test_public_docs_opens_only_the_docs(tiny_dir):
    s = Server(serve_config(tiny_dir, auth=AuthConfig(api_key=KEY, protect_health=True,
                                                       protect_metrics=True, public_docs=True))).start()
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            for path in DOCS:
                assert c.get(path).status_code == 200, path
            for path in ("/health", "/metrics", "/v1/models"):
                assert c.get(path).status_code == 401, path
    finally:
        s.stop()


def test_public_docs_is_a_cli_flag():
    ns = build_parser().parse_args(["serve", "--api-key", "k", "--public-docs"])
    assert from_namespace(ServeConfig, ns).auth.public_docs is True
    assert ServeConfig().auth.public_docs is False
