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


class VideoItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["video"]
    video: str = Field(description="Base64 of the encoded video file (MP4/MOV, WebM/MKV, AVI), or a data: URL.")


class VideoURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str = Field(description="A data: URL, or http(s) when the server allows URL fetching.")


class VideoUrlItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["video_url"]
    video_url: VideoURL


class VideoOptions(BaseModel):
    """How every video of the request is sampled and sized; unset fields take the
    checkpoint's video_preprocessor_config.json (else transformers' family defaults)."""

    model_config = ConfigDict(extra="forbid")
    # Strict: "2" or true is refused (422), never read as a number; an int is a float's value.
    fps: float | None = Field(default=None, gt=0, le=240, strict=True, description="Frames sampled per second of video.")
    min_frames: int | None = Field(default=None, ge=1, le=1 << 20, strict=True)
    max_frames: int | None = Field(default=None, ge=1, le=1 << 20, strict=True)
    min_pixels: int | None = Field(default=None, ge=1, le=1 << 40, strict=True, description="Per-frame (Qwen2-VL "
                                   "family) or per-video (Qwen3-VL family) pixel bounds, as the family's processor reads them.")
    max_pixels: int | None = Field(default=None, ge=1, le=1 << 40, strict=True)


_KNOWN_TYPES = ("image", "image_url", "video", "video_url")


class OtherItem(BaseModel):
    """Any other item type: accepted by the schema, refused with 415."""

    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _not_a_known_type(cls, v: str) -> str:
        # A malformed known item must fail the schema (422), not pass as "other" (415).
        if v in _KNOWN_TYPES:
            raise ValueError(f"malformed {v!r} item")
        return v


Item = Union[ImageItem, ImageUrlItem, VideoItem, VideoUrlItem, OtherItem]
Source = tuple[Literal["image", "video"], Literal["b64", "url"], str]  # (modality, encoding, value)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class PushTarget(BaseModel):
    model_config = ConfigDict(extra="allow")
    endpoint: str
    rank: int = Field(default=0, strict=True)
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
    """``inline`` (default), ``pull``, ``push`` to receivers (docs/protocol.md), or ``ec_store``:
    into the store of a vLLM EC connector (``--ec-store-*``, docs/integrations.md).

    Push fields are checked by ``check_delivery``, the rule ``EmbeddingReceiver.delivery()``
    applies too: a delivery the receiver builds is never refused here.
    """

    model_config = ConfigDict(extra="allow")
    mode: Literal["inline", "pull", "push", "ec_store"] = "inline"
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
    min_pixels: int | None = Field(default=None, ge=1, le=1 << 40, strict=True)  # strict: never "3136" or true
    max_pixels: int | None = Field(default=None, ge=1, le=1 << 40, strict=True)
    video_options: VideoOptions = Field(default_factory=VideoOptions)
    delivery: Delivery = Field(default_factory=Delivery)

    @model_validator(mode="after")
    def _one_source(self) -> "EncodeBody":
        if (self.items is None) == (self.messages is None):
            raise ValueError("give exactly one of 'items' or 'messages'")
        return self

    def sources(self) -> list[Source]:
        """The items as ``(modality, encoding, value)``; encoding is ``b64`` or ``url``. Raises 415."""
        out: list[Source] = []
        for item in self.items if self.items is not None else self._chat_items():
            if isinstance(item, ImageItem):
                out.append(("image", "b64", item.image))
            elif isinstance(item, ImageUrlItem):
                out.append(("image", "url", item.image_url.url))
            elif isinstance(item, VideoItem):
                out.append(("video", "b64", item.video))
            elif isinstance(item, VideoUrlItem):
                out.append(("video", "url", item.video_url.url))
            else:
                raise UnsupportedMedia(
                    f"unsupported item type {clip(item.type)}; use image, image_url, video or video_url")
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
                elif kind == "video_url" and isinstance(part.get("video_url"), dict):
                    items.append(VideoUrlItem(type="video_url", video_url=VideoURL(**part["video_url"])))
                elif kind == "video_url" and isinstance(part.get("video_url"), str):
                    items.append(VideoUrlItem(type="video_url", video_url=VideoURL(url=part["video_url"])))
                elif kind == "video" and isinstance(part.get("video"), str):
                    items.append(VideoItem(type="video", video=part["video"]))
                else:
                    items.append(OtherItem(type=str(kind)))
        return items


class VideoInfo(BaseModel):
    """What a prefill needs to place a video's tokens (mrope positions, timestamp text)."""

    frames_indices: list[int] = Field(description="Decode-order indices of the sampled frames, padding included.")
    fps: float = Field(description="The source video's frame rate.")
    total_num_frames: int | None = Field(default=None, description="Frames the indices were sampled from.")
    second_per_grid_ts: float | None = Field(default=None, description="Qwen2.5-VL: seconds per temporal patch.")
    timestamps: list[float] | None = Field(default=None, description="Qwen3-VL, Qwen3.5: seconds, per temporal patch.")


class ItemInfo(BaseModel):
    key: str
    num_tokens: int
    grid_thw: list[int]
    cache: Literal["hit", "miss", "coalesced", "pending"]
    hidden_size: int
    dtype: str
    num_deepstack: int
    modality: Literal["image", "video"] = "image"
    video: VideoInfo | None = None
    tier: Literal["device", "host", "shared"] | None = None  # hits only: L1, L2 or the fleet's L3
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
    modalities: list[Literal["image", "video"]] = ["image"]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class RoomStatus(BaseModel):
    room: str
    receiver: str
    request_id: str
    state: Literal["pending", "sending", "done", "failed"]
    code: str = Field(description="The typed error code of a failed room; empty otherwise.")
    reason: str
    opened: float = Field(description="Unix time the room was opened.")
    delivered: float | None = None
    finished: float | None = None
    targets: int


class ErrorDetail(BaseModel):
    code: str = Field(description="A stable code (epd_encoder.errors); the status is decided by it.")
    message: str = Field(max_length=512, description="Human text, at most 512 characters.")


class ErrorBody(BaseModel):
    """The body of every error answer (api/errors.py)."""

    error: ErrorDetail


class InfoLimits(BaseModel):
    """The server's request bounds (docs/operations.md), as configured."""

    max_items: int
    max_body_bytes: int
    max_image_bytes: int
    max_image_pixels: int
    max_aspect_ratio: float
    max_video_bytes: int
    max_video_seconds: float
    max_video_frame_pixels: int
    max_video_sampled_frames: int
    max_batch_cost: int
    max_batch_items: int
    max_pending_cost: int
    request_timeout_s: float


class InfoFeatures(BaseModel):
    modalities: list[Literal["image", "video"]]
    delivery_modes: list[Literal["inline", "pull", "push", "ec_store"]]
    push_backends: list[str]
    preprocess_backend: str
    tower: str
    batch_invariant: bool
    url_fetch: bool
    tp: int = Field(1, description="Tensor-parallel ranks (--tp); 1: the tower runs in this process.")
    tp_mode: Literal["weights", "data"] | None = Field(None, description="--tp-mode when tp > 1, else null.")


class InfoCpus(BaseModel):
    """The CPU budget the server sized its threads from (docs/operations.md, "Shared CPUs")."""

    threads: int = Field(description="torch intra-op threads in all (each of --tp N ranks runs threads // N).")
    source: str = Field(description="What chose it: --threads, affinity, or the cgroup quota file.")
    affinity: int = Field(description="CPUs in the process's affinity mask.")
    quota: float | None = Field(description="The cgroup CPU limit in cores; null when none is set.")
    host: int = Field(description="CPUs the host reports (torch's default pool size).")
    preprocess_workers: int
    wait_policy: str = Field(description="libgomp's OMP_WAIT_POLICY at start ('default' when unset).")


class InfoResponse(BaseModel):
    """What this server serves and within which bounds (like TEI's /info)."""

    version: str
    model: str = Field(description="The display id, as in responses and /v1/models.")
    revision: str = Field(description="Checkpoint digest and tower mode, hashed into content keys.")
    family: str
    dtype: str
    device: str
    hidden_size: int
    num_deepstack: int
    limits: InfoLimits
    features: InfoFeatures
    cpus: InfoCpus
