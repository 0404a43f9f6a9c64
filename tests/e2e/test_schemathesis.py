# SPDX-License-Identifier: Apache-2.0
"""Schemathesis against a real server: its /openapi.json is true to what it answers.

Every operation of the served document gets generated requests, valid and invalid ones;
no answer may be a 5xx, carry an undocumented status or content type, or break its
documented schema (the error body included). Examples are bounded to keep this < 60 s.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the 'test' extra")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from epd_encoder.config import AuthConfig  # noqa: E402
from tests.e2e.harness import Server, serve_config  # noqa: E402
from tests.e2e.hostile import AUTH, KEY  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 20  # per operation and mode


@pytest.fixture(scope="module")
def keyed(tiny_dir):
    s = Server(serve_config(tiny_dir, auth=AuthConfig(api_key=KEY))).start()
    yield s
    s.stop()


def _operations(url: str, headers: dict | None = None):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers or {})
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/encode", "/info", "/metrics", "/health"}, "the document lost routes"
    return ops


def _fuzz(op, url: str, mode: GenerationMode, headers: dict | None = None) -> set[int]:
    """Run the examples; the statuses seen (so a test can tell the requests really ran)."""
    seen: set[int] = set()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        seen.add(case.call_and_validate(base_url=url, headers=headers, checks=CHECKS, timeout=30).status_code)

    try:
        run()
    except Exception as e:
        raise AssertionError(f"{op.method} {op.path}") from e
    return seen


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_every_answer_matches_the_document(server, mode):
    ops = _operations(server.url)
    if mode is GenerationMode.NEGATIVE:  # an operation with no inputs has nothing to break
        ops = [op for op in ops if len(op.body) or len(op.path_parameters) or len(op.query)]
        assert {op.path for op in ops} == {"/v1/encode", "/v1/embeddings/{key}", "/v1/rooms/{room}"}
    seen = {f"{op.method} {op.path}": _fuzz(op, server.url, mode) for op in ops}
    assert seen["post /v1/encode"] & {400, 413, 415, 422}, seen  # bodies were sent and judged
    if mode is GenerationMode.POSITIVE:
        assert seen["get /info"] == seen["get /health"] == seen["get /metrics"] == {200}, seen


def test_keyed_server_answers_as_documented_with_and_without_the_key(keyed):
    ops = _operations(keyed.url, headers=AUTH)
    for op in ops:
        keyed_statuses = _fuzz(op, keyed.url, GenerationMode.POSITIVE, headers=AUTH)
        # Without the key a protected operation answers its documented 401.
        bare = _fuzz(op, keyed.url, GenerationMode.POSITIVE)
        assert 401 not in keyed_statuses, op.path
        assert (bare == {401}) == (op.path not in ("/health", "/metrics")), (op.path, bare)


def test_successful_answers_match_the_document(server):
    """Random bodies rarely hold a decodable image: the 200s and the 202 are checked on real ones."""
    from epd_encoder.receiver import EmbeddingReceiver
    from tests.e2e.harness import body, png

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    encode, pull = schema["/v1/encode"]["POST"], schema["/v1/embeddings/{key}"]["GET"]
    inline = encode.Case(body=body(png(1)), media_type="application/json")
    r = inline.call_and_validate(base_url=server.url, checks=CHECKS)
    assert r.status_code == 200 and r.headers["content-type"] == ["application/octet-stream"]
    pulled = encode.Case(body=body(png(2), delivery={"mode": "pull"}), media_type="application/json")
    r = pulled.call_and_validate(base_url=server.url, checks=CHECKS)
    assert r.status_code == 200 and r.json()["items"][0]["url"].startswith("/v1/embeddings/")
    key = r.json()["items"][0]["key"]
    r = pull.Case(path_parameters={"key": key}).call_and_validate(base_url=server.url, checks=CHECKS)
    assert r.status_code == 200
    with EmbeddingReceiver(backend="tcp") as rx:
        pushed = encode.Case(body=body(png(3), delivery=rx.delivery("room-doc")), media_type="application/json")
        r = pushed.call_and_validate(base_url=server.url, checks=CHECKS)
        assert r.status_code == 202 and r.json()["room"] == "room-doc"
        rx.wait("room-doc", timeout=20)
        rooms = schema["/v1/rooms/{room}"]["GET"]
        r = rooms.Case(path_parameters={"room": "room-doc"}, query={"receiver": rx.endpoint}).call_and_validate(
            base_url=server.url, checks=CHECKS)
        assert r.status_code == 200 and r.json()["state"] == "done"
