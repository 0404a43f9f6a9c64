# SPDX-License-Identifier: Apache-2.0
"""Runs one packed batch of preprocessed images through a vision tower."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from epd_encoder.errors import ConfigError, EncodeFailed, EncoderError, OutputMismatch
from epd_encoder.models.base import VisionTower
from epd_encoder.models.invariant import forward_units
from epd_encoder.models.registry import resolve_dtype
from epd_encoder.types import ItemOutput, PreprocessedImage


class VisionExecutor:
    """Encodes a batch of items of any sizes with ONE tower forward.

    ``encode`` concatenates the items' pixel rows (no padding), stacks their
    grids, runs ``tower.forward_packed`` under ``torch.inference_mode`` and
    splits the rows per item. Each item's output tensors are its own copies,
    so a cached item never pins the batch buffer. The token count of every
    item is checked before the forward (grid arithmetic vs the preprocessor's
    ``num_tokens``) and after it (rows returned); any disagreement raises
    ``OutputMismatch``. Any other failure of the forward raises ``EncodeFailed``
    with the cause attached. Outputs stay on the executor's device.

    With ``batch_invariant`` each unit of the batch (image, video, InternVL tile)
    runs through the tower alone, so its output is bitwise what it would be
    encoded alone, whatever it is batched with (see ``models/invariant.py``).

    On CUDA, host pixels cross on a side copy stream from pinned memory (``upload``):
    the compute stream waits on an event for them, so the copy of batch N+1 runs
    while batch N's kernels still run. Elsewhere ``upload`` is a plain ``.to``.
    """

    def __init__(self, tower: VisionTower, *, device: str | torch.device = "cpu", dtype: Any = "auto",
                 batch_invariant: bool = False) -> None:
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device is cuda but CUDA is not available")
        if isinstance(tower, torch.nn.Module):
            tower = tower.to(device=self.device, dtype=self.dtype).eval()
        self.tower = tower
        self.batch_invariant = batch_invariant
        self._forward = (lambda p, g: forward_units(tower.forward_packed, p, g)) if batch_invariant \
            else tower.forward_packed
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def expected_tokens(self, items: Sequence[PreprocessedImage]) -> list[int]:
        counts = []
        for i, item in enumerate(items):
            n = int(self.tower.tokens_for_grid(item.grid_thw))
            if n != item.num_tokens:
                raise OutputMismatch(
                    f"item {i}: grid {tuple(item.grid_thw)} gives {n} tokens but the preprocessor said {item.num_tokens}"
                )
            counts.append(n)
        return counts

    def encode(self, items: Sequence[PreprocessedImage]) -> list[ItemOutput]:
        if not items:
            return []
        counts = self.expected_tokens(items)
        with torch.inference_mode():
            pixels = self._to_device(
                items[0].pixel_values if len(items) == 1 else torch.cat([it.pixel_values for it in items])
            )
            grid = torch.tensor([tuple(it.grid_thw) for it in items], dtype=torch.long)
            try:
                emb, deep = self._forward(pixels, grid)
            except EncoderError:
                raise
            except Exception as e:  # the batch fails as a whole; the caller fails its items
                raise EncodeFailed(f"vision forward failed on a batch of {len(items)}: {e}") from e
            self._check_rows(emb, deep, sum(counts))
            return self._split(emb, deep, counts)

    def warmup(self, item: PreprocessedImage | None = None) -> None:
        """One small encode, so the first request pays no lazy init (kernels, allocator)."""
        if item is None:
            example = getattr(self.tower, "example_item", None)
            if example is None:
                raise ConfigError(f"{type(self.tower).__name__} has no example_item(); pass a warmup item")
            item = example()
        self.encode([item])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the executor's device, ordered before any later work on the current stream."""
        if host.device == self.device:
            return host
        if self._copy_stream is None or host.device.type != "cpu":
            return host.to(self.device, non_blocking=True)
        # pin_memory() takes a block of the caching host allocator; the copy records an event on
        # it, so the block is not handed out again before the copy has read it.
        pinned = host if host.is_pinned() else host.pin_memory()
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            out = pinned.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        compute.wait_event(done)
        out.record_stream(compute)  # allocated on the copy stream, freed after the compute stream's use
        return out

    def _to_device(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.upload(pixels)

    @staticmethod
    def _check_rows(emb: torch.Tensor, deep: list[torch.Tensor] | None, total: int) -> None:
        if emb.dim() != 2 or emb.shape[0] != total:
            raise OutputMismatch(f"tower returned {tuple(emb.shape)} rows; the grids need {total}")
        for j, d in enumerate(deep or ()):
            if d.shape[0] != total:
                raise OutputMismatch(f"deepstack {j} has {d.shape[0]} rows; the grids need {total}")

    @staticmethod
    def _split(emb: torch.Tensor, deep: list[torch.Tensor] | None, counts: list[int]) -> list[ItemOutput]:
        embs = emb.split(counts)
        deeps = [d.split(counts) for d in deep] if deep else None
        out = []
        for i, e in enumerate(embs):
            ds = None if deeps is None else tuple(_own(d[i]) for d in deeps)
            out.append(ItemOutput(_own(e), ds))
        return out


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is exactly its storage, else a contiguous copy."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)
