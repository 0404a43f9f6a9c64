# SPDX-License-Identifier: Apache-2.0
"""The one typed error set of epd-encoder.

Every failure a caller can see is an ``EncoderError`` subclass with a stable
``code`` string. The HTTP status for each class is decided in exactly one
place (``epd_encoder.api.errors``); nothing else maps errors to statuses.
Raise these with ``raise X(...) from cause`` so the cause is kept.
"""

from __future__ import annotations

import reprlib


class EncoderError(Exception):
    """Base of every error epd-encoder reports to a caller."""

    code = "internal"
    status: int | None = None  # the HTTP status, set by the client on an error it received

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)

    @property
    def message(self) -> str:
        return str(self)


# 400 -------------------------------------------------------------------------
class InvalidInput(EncoderError):
    """The input could not be understood."""

    code = "invalid_input"


class InvalidBase64(InvalidInput):
    """The image payload is not valid base64 or data URL."""

    code = "invalid_base64"


class UndecodableImage(InvalidInput):
    """The image bytes could not be decoded."""

    code = "undecodable_image"


class UndecodableVideo(InvalidInput):
    """The video bytes could not be decoded: corrupt, truncated or inconsistent."""

    code = "undecodable_video"


class BadAspectRatio(InvalidInput):
    """The image's aspect ratio is beyond the model's limit."""

    code = "bad_aspect_ratio"


class BodyNotAllowed(InvalidInput):
    """The request carries a body on a method that takes none (GET, HEAD, OPTIONS, ...)."""

    code = "body_not_allowed"


# 413 -------------------------------------------------------------------------
class TooLarge(EncoderError):
    """The input exceeds a size limit."""

    code = "too_large"


class ImageTooLarge(TooLarge):
    """The image exceeds the byte or pixel limit."""

    code = "image_too_large"


class VideoTooLarge(TooLarge):
    """The video exceeds a byte, pixel, duration, frame or decoded-pixel limit."""

    code = "video_too_large"


class TooManyItems(TooLarge):
    """The request has more items than allowed."""

    code = "too_many_items"


# 415 -------------------------------------------------------------------------
class UnsupportedMedia(EncoderError):
    """The image or video format, codec or item type is not supported."""

    code = "unsupported_media"


# 422 -------------------------------------------------------------------------
class SchemaError(EncoderError):
    """The request does not match the schema."""

    code = "schema_error"


# 401 -------------------------------------------------------------------------
class Unauthorized(EncoderError):
    """A missing or wrong bearer token."""

    code = "unauthorized"


# 404 -------------------------------------------------------------------------
class NotFound(EncoderError):
    """The embedding is unknown or no longer retained."""

    code = "not_found"


# 408 -------------------------------------------------------------------------
class BodyTimeout(EncoderError):
    """The request body did not arrive in full within its deadline."""

    code = "body_timeout"


# 409 -------------------------------------------------------------------------
class DuplicateRequest(EncoderError):
    """A request with this id is already in flight."""

    code = "duplicate_request"


# 429 -------------------------------------------------------------------------
class Overloaded(EncoderError):
    """The server is at its pending-work bound; retry later or elsewhere."""

    code = "overloaded"


# 503 -------------------------------------------------------------------------
class NotReady(EncoderError):
    """The server is not ready (loading, warming up or draining)."""

    code = "not_ready"


class RankFailed(EncoderError):
    """A tensor-parallel rank died, hung past the collective timeout or failed its protocol."""

    code = "rank_failed"


class RankMismatch(RankFailed):
    """Tensor-parallel ranks formed different batches (their batch digests differ)."""

    code = "rank_mismatch"


# 504 -------------------------------------------------------------------------
class RequestTimeout(EncoderError):
    """The request did not finish within its deadline."""

    code = "timeout"


# 499-like: the client went away. -----------------------------------------------
class Cancelled(EncoderError):
    """The request was cancelled before it finished."""

    code = "cancelled"


# 500 -------------------------------------------------------------------------
class EncodeFailed(EncoderError):
    """The vision tower failed on the batch that held this item."""

    code = "encode_failed"


class OutputMismatch(EncodeFailed):
    """The tower returned a token count that disagrees with the grid arithmetic."""

    code = "output_mismatch"


# Configuration / start-up (not request-scoped) --------------------------------
class ConfigError(EncoderError, ValueError):
    """The configuration or checkpoint is invalid."""

    code = "config_error"


class UnsupportedModel(ConfigError):
    """The checkpoint's model_type is not supported."""

    code = "unsupported_model"


class CheckpointError(ConfigError):
    """The checkpoint is missing tensors, has unexpected ones, or is malformed."""

    code = "checkpoint_error"


def clip(value: object, limit: int = 64) -> str:
    """``repr(value)`` in about ``limit`` characters: a client's value echoed in a message.

    ``reprlib`` cuts strings and containers before they are rendered: a huge one is never copied whole.
    """
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = max(limit, 8)
    text = r.repr(value)
    return text if len(text) <= limit + 8 else text[:limit] + "…"


def error_class(code: str) -> type[EncoderError]:
    """The class whose stable ``code`` this is; ``EncoderError`` for an unknown code.

    Found by walking the subclasses, so there is no second table to drift.
    """
    todo: list[type[EncoderError]] = [EncoderError]
    while todo:
        cls = todo.pop()
        if cls.code == code:
            return cls
        todo.extend(cls.__subclasses__())
    return EncoderError
