# SPDX-License-Identifier: Apache-2.0
"""The OpenAPI document states what the server answers (api/openapi.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from epd_encoder import errors as E
from epd_encoder.api.app import create_app
from epd_encoder.api.errors import error_body, status_of
from epd_encoder.api.openapi import ROUTE_ERRORS, codes_by_status
from epd_encoder.api.schemas import ErrorBody
from epd_encoder.config import AuthConfig, ServeConfig

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}


def doc(**auth) -> dict:
    config = replace(ServeConfig(), auth=AuthConfig(**auth)) if auth else ServeConfig()
    return create_app(config, lambda c, m: None).openapi()


def responses(d: dict, method: str, path: str) -> dict:
    return d["paths"][path][method]["responses"]


def _request_errors() -> list[type[E.EncoderError]]:
    out, todo = [], [E.EncoderError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if not issubclass(cls, E.ConfigError):
            out.append(cls)
    return out


def test_every_route_documents_its_error_statuses_with_the_real_body():
    d = doc()
    assert {(m, p) for p, ops in d["paths"].items() for m in ops} == set(ROUTE_ERRORS)
    for (method, path), statuses in ROUTE_ERRORS.items():
        answers = responses(d, method, path)
        for status in statuses:
            assert answers[str(status)]["content"] == {"application/json": {"schema": ERROR_REF}}, (path, status)
    # FastAPI's own validation-error shape is never sent: nothing refers to it.
    assert "HTTPValidationError" not in d["components"]["schemas"]
    assert "HTTPValidationError" not in str(d)


def test_the_error_schema_is_what_api_errors_builds():
    body = error_body("too_large", "x" * 2000)
    assert ErrorBody.model_validate(body).error.code == "too_large"
    detail = doc()["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"code", "message"} and detail["properties"]["message"]["maxLength"] == 512
    assert len(body["error"]["message"]) <= 512


def test_encode_lists_every_request_error_status_and_its_codes():
    answers = responses(doc(), "post", "/v1/encode")
    table = codes_by_status()
    for cls in _request_errors():
        status = status_of(cls())
        if cls in (E.Unauthorized, E.NotFound):  # 401 only when keyed; 404 is for pull keys and rooms
            continue
        assert str(status) in answers, cls
        assert f"`{cls.code}`" in answers[str(status)]["description"], cls
        assert cls.code in table[status]
    assert answers["429"]["headers"]["Retry-After"] and answers["503"]["headers"]["Retry-After"]


def test_encode_documents_inline_pull_and_push_answers():
    d = doc()
    answers = responses(d, "post", "/v1/encode")
    ok = answers["200"]["content"]
    assert ok["application/octet-stream"]["schema"] == {"type": "string", "format": "binary"}
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/PullResponse"}
    assert answers["202"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/PushResponse"}
    push = d["components"]["schemas"]["PushResponse"]
    assert set(push["required"]) == {"request_id", "model", "room", "items"}
    # The request body is still EncodeBody's schema, its refs inside itself.
    body = d["paths"]["/v1/encode"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "items" in body["properties"] and "delivery" in body["properties"]


def test_metrics_is_text_plain_and_binary_routes_are_octet_streams():
    d = doc()
    assert list(responses(d, "get", "/metrics")["200"]["content"]) == ["text/plain"]
    assert list(responses(d, "get", "/v1/embeddings/{key}")["200"]["content"]) == ["application/octet-stream"]
    key = d["paths"]["/v1/embeddings/{key}"]["get"]["parameters"][0]
    assert key["schema"]["pattern"] == "^[0-9a-f]{64}$"
    info = responses(d, "get", "/info")["200"]["content"]["application/json"]["schema"]
    assert info == {"$ref": "#/components/schemas/InfoResponse"}


def test_no_security_scheme_without_a_key():
    d = doc()
    assert "securitySchemes" not in d["components"] and "security" not in d
    assert all("401" not in op["responses"] and "security" not in op
               for ops in d["paths"].values() for op in ops.values())


@pytest.mark.parametrize("protect", [False, True])
def test_bearer_scheme_and_open_paths_follow_the_config(protect):
    d = doc(api_key="k", protect_health=protect, protect_metrics=protect)
    assert d["components"]["securitySchemes"] == {"bearerAuth": {"type": "http", "scheme": "bearer",
                                                                 "description": "--api-key"}}
    assert d["security"] == [{"bearerAuth": []}]
    for path, ops in d["paths"].items():
        for op in ops.values():
            open_ = path in ("/health", "/metrics") and not protect
            assert op["security"] == ([] if open_ else [{"bearerAuth": []}]), path
            assert ("401" in op["responses"]) is not open_, path
            if not open_:
                assert op["responses"]["401"]["headers"]["WWW-Authenticate"]


def test_docs_pages_are_not_operations():
    paths = doc(api_key="k", public_docs=True)["paths"]
    assert not any(p.startswith(("/docs", "/redoc", "/openapi")) for p in paths)
