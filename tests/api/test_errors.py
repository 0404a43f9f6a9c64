# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

from epd_encoder import errors as E
from epd_encoder.api.errors import STATUS, status_of


def all_errors(cls=E.EncoderError):
    for sub in cls.__subclasses__():
        yield sub
        yield from all_errors(sub)


EXPECTED = {
    E.InvalidBase64: 400, E.UndecodableImage: 400, E.BadAspectRatio: 400, E.InvalidInput: 400,
    E.Unauthorized: 401, E.NotFound: 404, E.DuplicateRequest: 409, E.ImageTooLarge: 413,
    E.TooManyItems: 413, E.UnsupportedMedia: 415, E.SchemaError: 422, E.Overloaded: 429,
    E.NotReady: 503, E.RequestTimeout: 504, E.EncodeFailed: 500, E.OutputMismatch: 500,
    E.Cancelled: 499, E.TooLarge: 413, E.BodyTimeout: 408,
    E.VideoTooLarge: 413, E.UndecodableVideo: 400,
}
# Errors that are meant to be a 500: the server's own failures, never the client's input.
SERVER_SIDE = (E.EncodeFailed, E.ConfigError)


@pytest.mark.parametrize("cls,status", sorted(EXPECTED.items(), key=lambda kv: kv[0].__name__))
def test_the_table(cls, status):
    assert status_of(cls("x")) == status


def test_every_error_class_has_a_distinct_code_and_a_status():
    classes = list(all_errors())
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), "two error classes share a code"
    for cls in classes:
        status = status_of(cls("x"))
        assert status != 500 or issubclass(cls, SERVER_SIDE), f"{cls.__name__} falls through to 500"


def test_the_mapping_is_ordered_most_specific_first():
    seen = []
    for cls, _ in STATUS:
        assert not any(issubclass(cls, earlier) for earlier in seen), cls
        seen.append(cls)


def test_a_not_ready_probe_logs_at_debug_and_a_not_ready_request_warns(caplog):
    import asyncio
    import threading

    import httpx

    from epd_encoder.api.app import create_app
    from epd_encoder.config import ServeConfig

    loading = threading.Event()

    def never_ready(config, metrics):
        loading.wait(5)
        raise RuntimeError("stopped")

    app = create_app(ServeConfig(), never_ready, load_in_background=True)

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                with caplog.at_level("DEBUG", logger="epd_encoder.api.errors"):
                    assert (await c.get("/health")).status_code == 503
                    assert (await c.post("/v1/encode", json={"items": []})).status_code == 503
            loading.set()

    asyncio.run(main())
    levels = {r.getMessage().split(":")[0]: r.levelname for r in caplog.records
              if r.name == "epd_encoder.api.errors"}
    assert levels == {"GET /health": "DEBUG", "POST /v1/encode": "WARNING"}
