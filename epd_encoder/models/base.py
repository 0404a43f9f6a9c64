# SPDX-License-Identifier: Apache-2.0
"""Interfaces between the model families, the loader and the executor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class VisionTower(Protocol):
    """A vision encoder (tower plus merger/projector) that runs packed batches.

    ``pixel_values`` is the concatenation of the items' ``PreprocessedImage.pixel_values``
    along dim 0 and ``grid_thw`` the ``[n_items, 3]`` int tensor of their grids.
    Returns the concatenated output rows ``[sum(num_tokens), out_hidden]`` and, for
    deepstack families (Qwen3-VL), the list of deepstack tensors with the same rows;
    ``None`` otherwise. Items never see each other (attention is per item).
    """

    def forward_packed(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]: ...

    def tokens_for_grid(self, grid_thw: Sequence[int]) -> int:
        """Output rows one item with this grid must produce (the grid arithmetic)."""
        ...


@dataclass(frozen=True)
class VisionFamily:
    """One supported model family, as the registry describes it.

    ``weight_prefixes`` are ``(checkpoint_prefix, module_prefix)`` pairs tried in
    order: a checkpoint tensor whose name starts with a checkpoint prefix belongs
    to the vision part and is renamed; every other tensor (the LM) is never read.
    """

    name: str
    model_types: tuple[str, ...]
    weight_prefixes: tuple[tuple[str, str], ...]
    build_tower: Callable[[Any], torch.nn.Module]  # from the full HF config object
    hf_reference: Callable[[Any], torch.nn.Module]  # transformers' own vision module (tests)
