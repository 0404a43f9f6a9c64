# SPDX-License-Identifier: Apache-2.0
"""Malformed bodies thrown at the OpenAPI schema: typed 4xx answers, never a crash."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.harness import b64, png

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["request_id", "items", "messages", "min_pixels", "max_pixels", "delivery", "type", "image",
          "image_url", "url", "mode", "role", "content"]
ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["image", "image_url", "video", "", "IMAGE"]) | st.text(max_size=5),
    "image": st.sampled_from(["", "AAAA", "data:image/png;base64,", "data:,x", b64(png(1, (8, 8)))]) | JSON,
    "image_url": st.fixed_dictionaries({}, optional={"url": st.text(max_size=30) | JSON}) | JSON,
})
BODY = st.fixed_dictionaries({}, optional={
    "request_id": st.text(max_size=140) | JSON,
    "items": st.lists(ITEM, max_size=3) | JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.text(max_size=5)}, optional={
        "content": st.lists(ITEM, max_size=2) | JSON}), max_size=2) | JSON,
    "min_pixels": st.integers(-5, 2**64) | JSON,
    "max_pixels": st.integers(-5, 2**64) | JSON,
    "delivery": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["inline", "pull", "push", ""])}) | JSON,
}) | st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=5) | JSON

ALLOWED = {200, 400, 413, 415, 422}


@pytest.fixture(scope="module")
def fuzz_client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=BODY)
def test_malformed_bodies_get_typed_errors(fuzz_client, payload):
    r = fuzz_client.post("/v1/encode", content=json.dumps(payload), headers={"content-type": "application/json"})
    assert r.status_code in ALLOWED, (payload, r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["code"], str) and isinstance(err["message"], str)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_non_json_bytes(fuzz_client, raw):
    r = fuzz_client.post("/v1/encode", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in ALLOWED


def test_openapi_schema_is_served_and_server_healthy_after_fuzzing(fuzz_client):
    spec = fuzz_client.get("/openapi.json").json()
    assert "/v1/encode" in spec["paths"] and "/v1/embeddings/{key}" in spec["paths"]
    assert fuzz_client.get("/docs").status_code == 200
    assert fuzz_client.get("/health").status_code == 200
    assert fuzz_client.post("/v1/encode", json={"items": [{"type": "image", "image": b64(png(3))}]}).status_code == 200
