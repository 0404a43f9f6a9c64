# SPDX-License-Identifier: Apache-2.0
"""Request and response schemas of the HTTP API (docs/api.md)."""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from epd_encoder.errors import UnsupportedMedia, clip
from epd_encoder.transfer import control as push

REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"


class ImageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # api/parse.py skips unknown fields unread
    type: Literal["image"]
    image: str = Field(description="Base64 of the encoded image file, or a data: URL.")


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str = Field(description="A data: URL, or http(s) when the server allows URL fetching.")
    detail: str | None = None


class ImageUrlItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # api/parse.py skips unknown fields unread
    type: Literal["image_url"]
    image_url: ImageURL


class OtherItem(BaseModel):
    """Any other item type: accepted by the schema, refused with 415."""

    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _not_a_known_type(cls, v: str) -> str:
        # A malformed image item must fail the schema (422), not pass as "other" (415).
        if v in ("image", "image_url"):
            raise ValueError(f"malformed {v!r} item")
        return v


Item = Union[ImageItem, ImageUrlItem, OtherItem]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class PushTarget(BaseModel):
    model_config = ConfigDict(extra="allow")
    endpoint: str
    rank: int = 0
    info: dict[str, Any] = Field(default_factory=dict)


def _shared(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A push rule of ``transfer/control.py`` as a pydantic validator (a 422 needs a ValueError)."""

    def run(value: Any) -> Any:
        if value is None:
            return None
        try:
            return check(value)
        except TypeError as e:
            raise ValueError(str(e)) from e

    return run


class Delivery(BaseModel):
    """``inline`` (default), ``pull``, or ``push`` to receivers (docs/protocol.md).

    Push fields are checked by ``check_delivery``, the rule ``EmbeddingReceiver.delivery()``
    applies too: a delivery the receiver builds is never refused here.
    """

    model_config = ConfigDict(extra="allow")
    mode: Literal["inline", "pull", "push"] = "inline"
    backend: str | None = None
    room: Annotated[str | None, BeforeValidator(_shared(push.room_name)),
                    Field(description="1-128 of [A-Za-z0-9._:-]; an int is its decimal string.")] = None
    targets: list[PushTarget] | None = Field(default=None, min_length=1, max_length=push.MAX_TARGETS)
    bootstrap_timeout: Annotated[float | None, BeforeValidator(_shared(push.bootstrap_seconds)),
                                 Field(description=f"Seconds, in (0, {push.MAX_BOOTSTRAP_S:g}].")] = None

    @model_validator(mode="after")
    def _push_fields(self) -> "Delivery":
        if self.mode == "push":
            if self.backend is None or self.room is None or not self.targets:
                raise ValueError("push delivery needs backend, room and targets")
            _shared(push.check_delivery)(self.model_dump())
        return self


class EncodeBody(BaseModel):
    """Either ``items`` or an OpenAI chat ``messages`` list, not both."""

    model_config = ConfigDict(extra="ignore")
    request_id: str | None = Field(default=None, pattern=REQUEST_ID_PATTERN)
    items: list[Item] | None = None
    messages: list[ChatMessage] | None = None
    min_pixels: int | None = Field(default=None, ge=1, le=1 << 40)
    max_pixels: int | None = Field(default=None, ge=1, le=1 << 40)
    delivery: Delivery = Field(default_factory=Delivery)

    @model_validator(mode="after")
    def _one_source(self) -> "EncodeBody":
        if (self.items is None) == (self.messages is None):
            raise ValueError("give exactly one of 'items' or 'messages'")
        return self

    def sources(self) -> list[tuple[str, str]]:
        """The items as ``(kind, value)``: kind is ``b64`` or ``url``. Raises 415."""
        out: list[tuple[str, str]] = []
        for item in self.items if self.items is not None else self._chat_items():
            if isinstance(item, ImageItem):
                out.append(("b64", item.image))
            elif isinstance(item, ImageUrlItem):
                out.append(("url", item.image_url.url))
            else:
                raise UnsupportedMedia(f"unsupported item type {clip(item.type)}; use image or image_url")
        return out

    def _chat_items(self) -> list[Item]:
        items: list[Item] = []
        for message in self.messages or ():
            if not isinstance(message.content, list):
                continue
            for part in message.content:
                kind = part.get("type")
                if kind in ("text", "input_text"):
                    continue
                if kind == "image_url" and isinstance(part.get("image_url"), dict):
                    items.append(ImageUrlItem(type="image_url", image_url=ImageURL(**part["image_url"])))
                elif kind == "image_url" and isinstance(part.get("image_url"), str):
                    items.append(ImageUrlItem(type="image_url", image_url=ImageURL(url=part["image_url"])))
                elif kind == "image" and isinstance(part.get("image"), str):
                    items.append(ImageItem(type="image", image=part["image"]))
                else:
                    items.append(OtherItem(type=str(kind)))
        return items


class ItemInfo(BaseModel):
    key: str
    num_tokens: int
    grid_thw: list[int]
    cache: Literal["hit", "miss", "coalesced", "pending"]
    hidden_size: int
    dtype: str
    num_deepstack: int
    url: str | None = None


class PushResponse(BaseModel):
    request_id: str
    model: str
    room: str
    items: list[ItemInfo]


class PullResponse(BaseModel):
    request_id: str
    model: str
    items: list[ItemInfo]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "epd-encoder"
    family: str
    hidden_size: int
    num_deepstack: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
