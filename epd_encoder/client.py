# SPDX-License-Identifier: Apache-2.0
"""Python clients for the encode tier's HTTP API (docs/api.md).

``EncodeClient`` (blocking) and ``AsyncEncodeClient`` (asyncio) have the same
surface. Every failure is an ``epd_encoder.errors.EncoderError``: a server
error body ``{"error": {"code", "message"}}`` raises the class whose ``code``
matches (``EncoderError`` for an unknown code) with ``.status`` set to the
HTTP status; an unreachable server raises ``NotReady`` and a timeout
``RequestTimeout``, each chained to the transport error.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import pathlib
import re
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union

import httpx
from PIL import Image

from epd_encoder import errors
from epd_encoder.errors import EncoderError, NotReady, RequestTimeout, SchemaError
from epd_encoder.types import ItemOutput
from epd_encoder.wire import ItemMeta, unpack_inline, unpack_item

if TYPE_CHECKING:  # torch loads only once a response's tensors are unpacked (wire.py)
    import numpy as np
    import torch

# A path, raw file bytes, a URL (http(s)/data:), a PIL image, a uint8 HWC array or
# tensor, or an ``items`` entry already built (``video_item``'s).
ImageInput = Union[
    bytes, bytearray, memoryview, str, pathlib.Path, Image.Image, Mapping[str, Any],
    "np.ndarray", "torch.Tensor",
]
# "inline", "pull", "ec_store" (into a vLLM EC connector's store; answered like pull, items
# not fetchable), or a push delivery dict from ``EmbeddingReceiver.delivery(room)``.
Delivery = Union[Literal["inline", "pull", "ec_store"], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class EncodedItem:
    """One item's result. ``embedding`` is ``None`` for a pull item not yet fetched."""

    embedding: torch.Tensor | None
    deepstack: list[torch.Tensor] | None
    key: str
    num_tokens: int
    grid_thw: tuple[int, int, int]
    cache: str
    modality: str = "image"
    video: dict | None = None  # frames_indices, fps, second_per_grid_ts / timestamps


@dataclasses.dataclass(frozen=True)
class EncodeResult:
    request_id: str
    model: str
    items: list[EncodedItem]


# -- request building and response parsing (shared by both clients) -------------


def video_item(video: "str | pathlib.Path | bytes") -> dict:
    """The ``items`` entry for one video file: URLs by reference, a path or bytes as base64."""
    if isinstance(video, str) and video.startswith(("data:", "http://", "https://")):
        return {"type": "video_url", "video_url": {"url": video}}
    if isinstance(video, (str, pathlib.Path)):
        data = pathlib.Path(video).read_bytes()
    elif isinstance(video, (bytes, bytearray, memoryview)):
        data = bytes(video)
    else:
        raise TypeError(f"cannot send a video of type {type(video).__name__}")
    return {"type": "video", "video": base64.b64encode(data).decode("ascii")}


_BASE64_RE = re.compile(r"[A-Za-z0-9+/_-]+={0,2}")


def _read_path(image: str | pathlib.Path) -> bytes:
    path = pathlib.Path(image)
    try:
        if path.is_file():
            return path.read_bytes()
    except OSError:  # a name too long for the file system is no file either
        pass
    if isinstance(image, str) and len(image) >= 64 and _BASE64_RE.fullmatch(image):
        raise ValueError(
            f"a {len(image)}-character string that is no existing file looks like raw base64; "
            "pass the decoded bytes (base64.b64decode(s)) or a data: URL instead"
        )
    raise FileNotFoundError(f"no such image file: {str(image)[:200]!r}")


def _array_png(image: Any) -> bytes:
    """A uint8 ``[H, W]`` or ``[H, W, C]`` (C in 1, 3, 4) array as PNG bytes."""
    torch = sys.modules.get("torch")  # never imported here: a tensor implies it is loaded
    shape, dtype = tuple(getattr(image, "shape", ())), str(getattr(image, "dtype", ""))
    if dtype.removeprefix("torch.") != "uint8" or not (
        len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3, 4))
    ):
        raise ValueError(
            f"an array image must be uint8 [H, W] or [H, W, C] with C in (1, 3, 4), got {dtype} "
            f"{tuple(shape)} (a CHW tensor needs .permute(1, 2, 0); floats need converting to uint8)"
        )
    if torch is not None and isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if len(shape) == 3 and shape[2] == 1:
        image = image[:, :, 0]
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _is_array(image: Any) -> bool:
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    return (np is not None and isinstance(image, np.ndarray)) or (
        torch is not None and isinstance(image, torch.Tensor)
    )


def image_item(image: ImageInput) -> dict:
    """The ``items`` entry for one image: URLs by reference, everything else as base64.

    A dict is taken as an item already built (``video_item``'s, say). A PIL image
    and a uint8 HWC numpy array or torch tensor are re-encoded as PNG, so their
    content key is that PNG's, not the key of the file they were read from. A str
    is a URL or a path; raw base64 text raises ``ValueError`` (decode it first).
    """
    if isinstance(image, Mapping):
        return dict(image)
    if isinstance(image, str) and image.startswith(("data:", "http://", "https://")):
        return {"type": "image_url", "image_url": {"url": image}}
    if isinstance(image, (str, pathlib.Path)):
        data = _read_path(image)
    elif isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        data = buf.getvalue()
    elif isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif _is_array(image):
        data = _array_png(image)
    else:
        raise TypeError(f"cannot send an image of type {type(image).__name__}")
    return {"type": "image", "image": base64.b64encode(data).decode("ascii")}


def encode_body(
    *,
    items: list[dict] | None = None,
    messages: list[dict] | None = None,
    request_id: str | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    delivery: Delivery = "inline",
    video_options: Mapping[str, Any] | None = None,
) -> dict:
    """The JSON body of ``POST /v1/encode``; unset options are left out."""
    if isinstance(delivery, Mapping):
        if delivery.get("mode") != "push":
            raise ValueError("a delivery dict must be a push delivery (EmbeddingReceiver.delivery)")
    elif delivery not in ("inline", "pull", "ec_store"):
        raise ValueError(f"delivery must be 'inline', 'pull', 'ec_store' or a push dict, got {delivery!r}")
    body: dict[str, Any] = {"items": items} if messages is None else {"messages": messages}
    for name, value in (("request_id", request_id), ("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None:
            body[name] = value
    if video_options:
        body["video_options"] = dict(video_options)
    body["delivery"] = dict(delivery) if isinstance(delivery, Mapping) else {"mode": delivery}
    return body


def error_from_response(response: httpx.Response) -> EncoderError:
    """The typed error a non-2xx response stands for."""
    code, message = None, None
    try:
        err = response.json().get("error")
        code, message = err.get("code"), err.get("message")
    except (ValueError, AttributeError):
        pass
    if not isinstance(code, str):
        code = {401: errors.Unauthorized.code, 404: errors.NotFound.code}.get(response.status_code)
    cls = errors.error_class(code) if code else EncoderError
    if not isinstance(message, str) or not message:
        message = f"HTTP {response.status_code}: {response.text[:200]}"
    exc = cls(message)
    exc.status = response.status_code
    return exc


def _check(response: httpx.Response) -> httpx.Response:
    if not response.is_success:
        raise error_from_response(response)
    return response


def _item_of(meta: ItemMeta, output: ItemOutput | None = None) -> EncodedItem:
    return EncodedItem(
        embedding=None if output is None else output.embedding,
        deepstack=None if output is None or output.deepstack is None else list(output.deepstack),
        key=meta.key,
        num_tokens=meta.num_tokens,
        grid_thw=meta.grid_thw,
        cache=meta.cache,
        modality=meta.modality,
        video=meta.video,
    )


def parse_encode(response: httpx.Response, delivery: Delivery) -> EncodeResult:
    """The result of a successful ``POST /v1/encode``: pull items unfetched, push items
    as the 202's metadata (``cache`` is ``hit`` or ``pending`` before the forward)."""
    if delivery == "inline":
        info, items = unpack_inline(response.content)
        return EncodeResult(info["request_id"], info["model"], [_item_of(m, o) for m, o in items])
    try:
        doc = response.json()
        request_id, model, raw_items = doc["request_id"], doc["model"], doc["items"]
    except (ValueError, KeyError, TypeError) as e:
        raise SchemaError("pull response is not the documented JSON object") from e
    if not isinstance(raw_items, list) or not isinstance(request_id, str) or not isinstance(model, str):
        raise SchemaError("pull response has mistyped fields")
    if isinstance(delivery, Mapping):  # push: the outcome is not known yet
        return EncodeResult(request_id, model, [_pending_item(d) for d in raw_items])
    return EncodeResult(request_id, model, [_item_of(ItemMeta.from_json(d)) for d in raw_items])


def _pending_item(d: Any) -> EncodedItem:
    if not isinstance(d, dict) or d.get("cache") not in ("hit", "pending"):
        raise SchemaError(f"push response item is malformed: {d!r}")
    # "pending" is no stored state: checked as a miss; a hit keeps its tier.
    item = _item_of(ItemMeta.from_json({**d, "cache": "hit" if d["cache"] == "hit" else "miss"}))
    return dataclasses.replace(item, cache=d["cache"])


def parse_fetch(response: httpx.Response) -> EncodedItem:
    _, meta, output = unpack_item(response.content)
    return _item_of(meta, output)


def _with_items(result: EncodeResult, fetched: Sequence[EncodedItem]) -> EncodeResult:
    # The listing's cache state is this request's; the stored item's may be an earlier one's.
    items = [dataclasses.replace(f, cache=it.cache) for it, f in zip(result.items, fetched)]
    return EncodeResult(result.request_id, result.model, items)


def _models(response: httpx.Response) -> list[dict]:
    try:
        data = response.json()["data"]
    except (ValueError, KeyError, TypeError) as e:
        raise SchemaError("models response is not the documented JSON object") from e
    if not isinstance(data, list):
        raise SchemaError("models response 'data' must be a list")
    return data


def _embedding_path(key: str) -> str:
    return f"/v1/embeddings/{key}"


def _client_kwargs(base_url: str, api_key: str | None, timeout: float, transport) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    kw: dict[str, Any] = {"base_url": base_url, "headers": headers, "timeout": httpx.Timeout(timeout)}
    if transport is not None:
        kw["transport"] = transport
    return kw


def _transport_error(e: httpx.TransportError, url: str) -> EncoderError:
    if isinstance(e, httpx.TimeoutException):
        return RequestTimeout(f"{url}: timed out ({type(e).__name__})")
    return NotReady(f"{url}: unreachable ({type(e).__name__}: {e})")


# -- the clients -----------------------------------------------------------------


class EncodeClient:
    """A blocking client; use as a context manager or call ``close()``."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout: float = 60.0, transport=None
    ) -> None:
        self._http = httpx.Client(**_client_kwargs(base_url, api_key, timeout, transport))

    def __enter__(self) -> EncodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            return self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise _transport_error(e, path) from e

    def encode(
        self,
        images: Sequence[ImageInput],
        *,
        request_id: str | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        delivery: Delivery = "inline",
        fetch: bool = False,
        video_options: Mapping[str, Any] | None = None,
    ) -> EncodeResult:
        """Encode ``images`` (a ``video_item(...)`` dict is a video); with ``delivery="pull"``
        and ``fetch`` also fetch every item."""
        body = encode_body(items=[image_item(im) for im in images], request_id=request_id,
                           min_pixels=min_pixels, max_pixels=max_pixels, delivery=delivery,
                           video_options=video_options)
        return self._post_encode(body, delivery, fetch)

    def encode_chat(self, messages: list[dict], *, delivery: Delivery = "inline", fetch: bool = False,
                    **kw) -> EncodeResult:
        """Encode every ``image_url`` part of an OpenAI chat ``messages`` list, in order."""
        body = encode_body(messages=messages, delivery=delivery, **kw)
        return self._post_encode(body, delivery, fetch)

    def _post_encode(self, body: dict, delivery: Delivery, fetch: bool) -> EncodeResult:
        result = parse_encode(_check(self._request("POST", "/v1/encode", json=body)), delivery)
        if delivery == "pull" and fetch:
            result = _with_items(result, [self.fetch(it.key) for it in result.items])
        return result

    def fetch(self, key: str) -> EncodedItem:
        """``GET /v1/embeddings/{key}``: a pulled item with its tensors (``NotFound`` once expired)."""
        return parse_fetch(_check(self._request("GET", _embedding_path(key))))

    def health(self) -> bool:
        """Whether the server is ready; ``False`` when it is unreachable or not ready."""
        try:
            response = self._request("GET", "/health")
        except EncoderError:
            return False
        if response.status_code in (401, 403):
            raise error_from_response(response)
        return response.is_success

    def models(self) -> list[dict]:
        return _models(_check(self._request("GET", "/v1/models")))


class AsyncEncodeClient:
    """The asyncio twin of ``EncodeClient``; ``fetch=True`` pulls items concurrently."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout: float = 60.0, transport=None
    ) -> None:
        self._http = httpx.AsyncClient(**_client_kwargs(base_url, api_key, timeout, transport))

    async def __aenter__(self) -> AsyncEncodeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            return await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise _transport_error(e, path) from e

    async def encode(
        self,
        images: Sequence[ImageInput],
        *,
        request_id: str | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        delivery: Delivery = "inline",
        fetch: bool = False,
        video_options: Mapping[str, Any] | None = None,
    ) -> EncodeResult:
        body = encode_body(items=[image_item(im) for im in images], request_id=request_id,
                           video_options=video_options,
                           min_pixels=min_pixels, max_pixels=max_pixels, delivery=delivery)
        return await self._post_encode(body, delivery, fetch)

    async def encode_chat(self, messages: list[dict], *, delivery: Delivery = "inline",
                          fetch: bool = False, **kw) -> EncodeResult:
        body = encode_body(messages=messages, delivery=delivery, **kw)
        return await self._post_encode(body, delivery, fetch)

    async def _post_encode(self, body: dict, delivery: Delivery, fetch: bool) -> EncodeResult:
        result = parse_encode(_check(await self._request("POST", "/v1/encode", json=body)), delivery)
        if delivery == "pull" and fetch:
            result = _with_items(result, await asyncio.gather(*(self.fetch(it.key) for it in result.items)))
        return result

    async def fetch(self, key: str) -> EncodedItem:
        return parse_fetch(_check(await self._request("GET", _embedding_path(key))))

    async def health(self) -> bool:
        try:
            response = await self._request("GET", "/health")
        except EncoderError:
            return False
        if response.status_code in (401, 403):
            raise error_from_response(response)
        return response.is_success

    async def models(self) -> list[dict]:
        return _models(_check(await self._request("GET", "/v1/models")))
