# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import httpx
import pytest

from epd_encoder.models.tiny import write_tiny_model
from tests.e2e.harness import Server, serve_config


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return write_tiny_model("qwen3_vl", tmp_path_factory.mktemp("tiny") / "qwen3_vl")


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = Server(serve_config(tiny_dir)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def locked(tiny_dir):
    """A server whose every route, /health and /metrics included, needs the API key."""
    from epd_encoder.config import AuthConfig
    from tests.e2e.hostile import KEY

    s = Server(serve_config(tiny_dir, auth=AuthConfig(api_key=KEY, protect_health=True,
                                                       protect_metrics=True))).start()
    yield s
    s.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c
