# SPDX-License-Identifier: Apache-2.0
"""Batch-invariant vision forwards: each unit of a packed batch runs alone.

A CPU GEMM picks its kernel, its blocking and its thread split from the row
count of the call, and threaded elementwise kernels split their range by the
element count; either moves the last bits of a row with what it is batched
with. Here every unit (one image or one temporal group of a video in a packed
Qwen batch, one tile of an InternVL batch) runs through the module on its own, from a freshly
allocated contiguous copy, so every kernel sees exactly the shapes,
alignment and values it sees for that unit alone. The result is bitwise
equal to encoding the unit alone, by construction, for any module, dtype,
CPU and batch composition, at a fixed intra-op thread count.

``batch_invariant(model)`` applies the same split to any torch module that
holds a packed vision tower: ours (``forward_packed``), transformers' Qwen
vision models (``forward(hidden_states, grid_thw)``) and InternVL's vision
model and projector (batched by tile), so an aggregated reference model
computes exactly what ``--batch-invariant`` serves.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["batch_invariant", "forward_units", "split_units", "merge_outputs"]

# transformers' InternVL modules that take a batch of tiles along dim 0.
_TILE_BATCHED = ("InternVLVisionModel", "InternVLMultiModalProjector")


def split_units(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The units of a packed batch, each as (own contiguous pixels, its ``[1, 3]`` grid).

    4-D pixels are tiles (InternVL): one unit per tile. 2-D pixels are patch rows
    (Qwen): one unit per temporal group, ``h*w`` rows with grid ``(1, h, w)``. Every
    Qwen tower attends within one temporal group and repeats its position tables per
    group, so this is the same function; and a video encoded in chunks of whole groups
    (engine parts) is then bitwise the video encoded whole.
    """
    grids = torch.as_tensor(grid_thw).reshape(-1, 3)
    if pixel_values.dim() == 4 and pixel_values.shape[0] != sum(int(g[0]) for g in grids.tolist()):
        # Kimi K2.5: 4-D patches, t*h*w per item (never t, as tiles are). Its frames attend
        # together and are averaged into one set of tokens, so the whole item is the unit.
        rows = [math.prod(g) for g in grids.tolist()]
        return [(p.clone(), grids[i:i + 1].clone()) for i, p in enumerate(pixel_values.split(rows))]
    if pixel_values.dim() == 4:
        unit_grids = [g for g in grids.tolist() for _ in range(int(g[0]))]
        return [(pixel_values[i:i + 1].clone(), torch.tensor([[1, g[1], g[2]]], dtype=grids.dtype))
                for i, g in enumerate(unit_grids)]
    unit_grids = [(1, g[1], g[2]) for g in grids.tolist() for _ in range(int(g[0]))]
    rows = [math.prod(g) for g in unit_grids]
    return [(p.clone(), torch.tensor([g], dtype=grids.dtype)) for p, g in zip(pixel_values.split(rows), unit_grids)]


def merge_outputs(parts: list[Any]) -> Any:
    """Concatenate per-unit outputs along dim 0: tensors, sequences and dict-like outputs."""
    first = parts[0]
    if len(parts) == 1 or first is None:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, (list, tuple)):
        merged = [merge_outputs([p[i] for p in parts]) for i in range(len(first))]
        return type(first)(merged) if isinstance(first, list) else tuple(merged)
    if isinstance(first, dict):  # transformers' ModelOutput is a dict subclass
        return type(first)(**{k: merge_outputs([p[k] for p in parts]) for k in first})
    raise TypeError(f"cannot merge per-unit outputs of type {type(first).__name__}")


def forward_units(forward: Callable[..., Any], pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
    """``forward(pixels, grid)`` once per unit, outputs concatenated."""
    return merge_outputs([forward(p, g) for p, g in split_units(pixel_values, grid_thw)])


def _first_arg(name: str, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """The batched first argument, given by position or by ``name``, and the rest."""
    return (args[0], args[1:]) if args else (kwargs.pop(name), args)


def _per_unit(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        hidden, rest = _first_arg("hidden_states", args, kwargs)
        grid = rest[0] if rest else kwargs.pop("grid_thw")
        return forward_units(lambda p, g: forward(p, grid_thw=g, **kwargs), hidden, grid)
    return run


def _per_tile(forward: Callable[..., Any], name: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        x, rest = _first_arg(name, args, kwargs)
        return merge_outputs([forward(x[i:i + 1].clone(), *rest, **kwargs) for i in range(x.shape[0])])
    return run


def _per_image_features(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Kimi K2.5's ``get_image_features(pixel_values, image_grid_thw)``: its projector also
    runs on the packed rows, so tower and projector run per image; the per-image tuples of
    ``pooler_output`` are joined, the other fields concatenated."""
    def run(*args: Any, **kwargs: Any) -> Any:
        pixels, rest = _first_arg("pixel_values", args, kwargs)
        grid = rest[0] if rest else kwargs.pop("image_grid_thw")
        parts = [forward(p, g, **kwargs) for p, g in split_units(pixels, grid)]
        first = parts[0]
        return type(first)(**{k: tuple(t for p in parts for t in p[k]) if k == "pooler_output"
                              else merge_outputs([p[k] for p in parts]) for k in first})
    return run


def _packed_forward(module: nn.Module) -> tuple[str, Callable] | None:
    """Which method of ``module`` runs a packed batch, and its per-unit replacement."""
    if callable(getattr(module, "forward_packed", None)):
        fn = module.forward_packed
        return "forward_packed", lambda p, g: forward_units(fn, p, g)
    if type(module).__name__ == "Kimi_K25Model":
        return "get_image_features", _per_image_features(module.get_image_features)
    params = list(inspect.signature(module.forward).parameters)
    if type(module).__name__ in _TILE_BATCHED:
        return "forward", _per_tile(module.forward, params[0])
    if params[:2] == ["hidden_states", "grid_thw"]:
        return "forward", _per_unit(module.forward)
    return None


@contextlib.contextmanager
def batch_invariant(*modules: nn.Module) -> Iterator[None]:
    """Within the block, every packed vision forward inside ``modules`` runs unit by unit.

    The outermost packed module found on each path is patched (its descendants then
    only ever see one unit); every patch is undone on exit. Not reentrant for the
    same module from two threads.
    """
    patched: list[tuple[nn.Module, str, Any]] = []

    def visit(m: nn.Module) -> None:
        found = _packed_forward(m)
        if found is None:
            for child in m.children():
                visit(child)
            return
        name, replacement = found
        patched.append((m, name, m.__dict__.get(name)))
        setattr(m, name, replacement)

    try:
        for module in modules:
            visit(module)
        yield
    finally:
        for m, name, before in reversed(patched):
            if before is None:
                delattr(m, name)
            else:
                setattr(m, name, before)
