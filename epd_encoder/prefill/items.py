# SPDX-License-Identifier: Apache-2.0
"""What the prefill reads of a received item, and the checks on its rows.

An item is anything with ``embedding``, ``deepstack`` and ``grid_thw``
(``hf.VisionItem``). Optionally ``modality`` (``"image"`` when absent, so
image-only callers are unchanged, or ``"video"``) and, for a video, its
timing: ``second_per_grid_ts`` and ``timestamps``, as attributes or in the
item's ``video`` dict (what the client's ``EncodedItem`` and the receiver's
``ReceivedItem`` carry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from epd_encoder.errors import InvalidInput

__all__ = ["PrefillItem", "as_video", "check_rows", "item_modality", "video_meta"]

IMAGE, VIDEO = "image", "video"


@dataclass(frozen=True)
class PrefillItem:
    """A concrete ``VisionItem``: what the prefill needs of one image or video."""

    embedding: torch.Tensor | None
    grid_thw: tuple[int, int, int]
    deepstack: list[torch.Tensor] | None = None
    modality: str = IMAGE
    second_per_grid_ts: float | None = None
    timestamps: tuple[float, ...] | None = None


def as_video(item: Any, *, second_per_grid_ts: float | None = None,
             timestamps: Sequence[float] | None = None) -> PrefillItem:
    """A received item (``EncodedItem``, ``ReceivedItem``, ...) marked as a video with its metadata."""
    grid = cast("tuple[int, int, int]", tuple(int(g) for g in item.grid_thw))  # checked in check_rows
    base = PrefillItem(getattr(item, "embedding", None), grid, getattr(item, "deepstack", None))
    ts = None if timestamps is None else tuple(float(t) for t in timestamps)
    return replace(base, modality=VIDEO, second_per_grid_ts=second_per_grid_ts, timestamps=ts)


def item_modality(item: Any) -> str:
    """``"image"`` or ``"video"``; an item without ``modality`` is an image."""
    m = getattr(item, "modality", None) or IMAGE
    if m not in (IMAGE, VIDEO):
        raise InvalidInput(f"modality must be 'image' or 'video', got {m!r}")
    return m


def video_meta(item: Any, key: str) -> Any:
    """``item.<key>``, else ``item.video[key]``: the client's ``EncodedItem`` and the
    receiver's ``ReceivedItem`` carry a video's timing in their ``video`` dict."""
    value = getattr(item, key, None)
    if value is None and isinstance(getattr(item, "video", None), dict):
        value = item.video.get(key)
    return value


def check_rows(config: Any, pairs: Sequence[tuple[int, Any]], merge: int, hidden: int, n_deep: int):
    """Each item's rows against its grid and the family; ``(grids, embeds, deepstack[layer][item])``.

    ``pairs`` are ``(index in the request, item)``; messages name that index.
    """
    grids, embeds = [], []
    deep: list[list[torch.Tensor]] = [[] for _ in range(n_deep)]
    for i, item in pairs:
        emb, grid = item.embedding, tuple(int(g) for g in item.grid_thw)
        if emb is None:
            raise InvalidInput(f"item {i} has no embedding (a pull item not fetched yet?)")
        if len(grid) != 3:
            raise InvalidInput(f"item {i}: grid_thw must be (t, h, w), got {grid}")
        want = grid[0] * grid[1] * grid[2] // (merge * merge)
        if emb.dim() != 2 or emb.shape[0] != want or emb.shape[1] != hidden:
            raise InvalidInput(
                f"item {i}: embedding shape {tuple(emb.shape)}, grid {grid} needs [{want}, {hidden}]"
            )
        ds = list(item.deepstack or ())
        if len(ds) != n_deep:
            raise InvalidInput(f"item {i}: {len(ds)} deepstack tensors, {config.model_type} needs {n_deep}")
        for j, t in enumerate(ds):
            if tuple(t.shape) != tuple(emb.shape):
                raise InvalidInput(f"item {i}: deepstack {j} shape {tuple(t.shape)} != {tuple(emb.shape)}")
            deep[j].append(t)
        grids.append(grid)
        embeds.append(emb)
    return grids, embeds, deep
