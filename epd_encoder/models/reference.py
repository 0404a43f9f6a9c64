# SPDX-License-Identifier: Apache-2.0
"""transformers' own vision module behind the ``VisionTower`` interface.

``--tower reference`` serves it instead of our fast tower. It is slower. An
item encoded alone is bitwise what the aggregated transformers model computes
for it alone (the same module on the same input). A packed batch runs other
GEMM shapes, which move the last bits (~1e-7, by CPU and thread count); with
``--batch-invariant`` every item runs alone, so a prefill fed by it reproduces
the aggregated logits exactly when the aggregated model runs under
``models.invariant.batch_invariant``. Our fast tower agrees to ~1e-7.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from epd_encoder.models.base import VisionFamily


class ReferenceTower(nn.Module):
    def __init__(self, family: VisionFamily, config: Any) -> None:
        super().__init__()
        self.family = family.name
        self.inner = family.hf_reference(config)
        # Token arithmetic comes from our tower's definition, built without weights;
        # a list keeps it out of the module tree and the state dict.
        with torch.device("meta"):
            self._shape = [family.build_tower(config)]

    def tokens_for_grid(self, grid_thw: Sequence[int]) -> int:
        return self._shape[0].tokens_for_grid(grid_thw)

    def forward_packed(self, pixel_values: torch.Tensor,
                       grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        if self.family == "internvl":
            return self.inner(pixel_values), None
        out = self.inner(pixel_values, grid_thw=grid_thw)
        deep = getattr(out, "deepstack_features", None)
        return out.pooler_output, (list(deep) if deep else None)


def build_reference(family: VisionFamily, config: Any) -> ReferenceTower:
    return ReferenceTower(family, config)
