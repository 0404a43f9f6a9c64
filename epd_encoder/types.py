# SPDX-License-Identifier: Apache-2.0
"""Value types shared by the engine, the models and delivery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays an optional import for pure bookkeeping users
    import torch


@dataclass(frozen=True)
class ItemOutput:
    """The full vision output of one item: never store or ship half of it.

    ``embedding`` is ``[num_tokens, hidden]``. ``deepstack`` holds the
    per-layer deepstack tensors of Qwen3-VL (each ``[num_tokens, hidden]``)
    and is ``None`` for families without them.
    """

    embedding: "torch.Tensor"
    deepstack: "tuple[torch.Tensor, ...] | None" = None

    @property
    def num_tokens(self) -> int:
        return int(self.embedding.shape[0])

    @property
    def nbytes(self) -> int:
        n = self.embedding.numel() * self.embedding.element_size()
        for t in self.deepstack or ():
            n += t.numel() * t.element_size()
        return n

    def joined(self) -> "torch.Tensor":
        """``[num_tokens, hidden * (1 + num_deepstack)]``: the deepstack tensors appended on the
        hidden axis, the layout vLLM's and SGLang's Qwen3-VL language models split back."""
        if not self.deepstack:
            return self.embedding
        import torch

        return torch.cat([self.embedding, *self.deepstack], dim=-1)

    def map(self, fn) -> "ItemOutput":
        """Apply a tensor function (a device copy, say) to every tensor."""
        ds = None if self.deepstack is None else tuple(fn(t) for t in self.deepstack)
        return ItemOutput(fn(self.embedding), ds)


@dataclass(frozen=True)
class PreprocessedImage:
    """One image after decode, resize, normalize and patchify: the tower's input.

    Qwen families: ``pixel_values`` is ``[t*h*w, C*T*P*P]`` (pre-merge patches in
    the order the HF processor emits them) and ``grid_thw`` is the patch grid.
    Tile families (InternVL): ``pixel_values`` is ``[tiles, C, S, S]`` and
    ``grid_thw`` is ``(tiles, S // patch, S // patch)``: one grid per tile.

    ``num_patches`` is the pre-merge patch count (the scheduler's default cost
    unit); ``num_tokens`` is the number of output embedding rows.
    """

    pixel_values: "torch.Tensor"
    grid_thw: tuple[int, int, int]
    num_tokens: int

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w
