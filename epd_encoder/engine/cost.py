# SPDX-License-Identifier: Apache-2.0
"""The scheduler's cost unit: the vision tower's work for one item."""

from __future__ import annotations

import math
from collections.abc import Sequence


def item_cost(
    grid_thw: Sequence[int],
    *,
    attention_weight: float = 0.0,
    window_patches: int | None = None,
) -> int:
    """Return the scheduling cost of one item with patch grid ``(t, h, w)``.

    The base cost is the pre-merge patch count ``t*h*w``: every layer of the
    ViT runs on every patch. Post-merge tokens undercount that work: the
    merger folds each 2x2 block of patches into one token only after the ViT
    has processed all four, so counting tokens undercounts by the merge factor
    (4x for a 2x2 merge) and mis-ranks items against the patch budget.

    Attention is quadratic in the length of each full-attention window, which
    a linear count misses for large images. With ``attention_weight > 0`` the
    cost adds ``ceil(attention_weight * sum(n_w ** 2))`` over the windows
    ``w``: each frame (or tile, for tile families) is one window of ``h*w``
    patches, or, with ``window_patches`` set, is cut into windows of at most
    that many patches. Per layer, a window of ``n`` patches costs about
    ``2*n*n*d`` attention FLOPs against ``12*d*d`` linear FLOPs per patch, so
    ``attention_weight = 1 / (6 * hidden_size)`` puts both in patch units.

    Raises ``ValueError`` for a non-positive grid dimension, a negative
    weight, or a non-positive ``window_patches``.
    """
    if len(grid_thw) != 3:
        raise ValueError(f"grid_thw must be (t, h, w), got {tuple(grid_thw)!r}")
    t, h, w = (int(d) for d in grid_thw)
    if t <= 0 or h <= 0 or w <= 0:
        raise ValueError(f"grid_thw dimensions must be positive, got {(t, h, w)}")
    if not attention_weight >= 0.0:
        raise ValueError(f"attention_weight must be >= 0, got {attention_weight}")
    frame = h * w
    patches = t * frame
    if attention_weight == 0.0:
        return patches
    if window_patches is None:
        quadratic = t * frame * frame
    else:
        if window_patches <= 0:
            raise ValueError(f"window_patches must be positive, got {window_patches}")
        full, rest = divmod(frame, window_patches)
        quadratic = t * (full * window_patches * window_patches + rest * rest)
    return patches + math.ceil(attention_weight * quadratic)
