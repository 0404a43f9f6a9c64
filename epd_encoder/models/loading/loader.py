# SPDX-License-Identifier: Apache-2.0
"""Vision-only weight loading from a local safetensors checkpoint."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from blake3 import blake3

from epd_encoder.errors import CheckpointError
from epd_encoder.models.loading.checkpoint import read_checkpoint

logger = logging.getLogger(__name__)

_NAMES_SHOWN = 20


@dataclass
class LoadReport:
    """What a load touched: shard files opened and skipped, tensors and bytes read.

    ``bytes`` counts the checkpoint bytes of the tensors read (before any cast);
    ``digest`` is a blake3 over their names, dtypes, shapes and bytes: it
    identifies the vision weights themselves (two fine-tunes differ).
    """

    shards_opened: list[str] = field(default_factory=list)
    shards_skipped: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    digest: str = ""


def _rename(name: str, weight_prefixes: Sequence[tuple[str, str]]) -> str | None:
    for ckpt_prefix, module_prefix in weight_prefixes:
        if name.startswith(ckpt_prefix):
            return module_prefix + name[len(ckpt_prefix):]
    return None


def _read(path: Path, names: Sequence[tuple[str, str]], take: Callable[[str, Any], torch.Tensor] | None = None):
    """Yield ``(target, tensor)`` for ``names`` of one file, one tensor at a time.

    ``take(target, safetensors_slice)`` reads part of a tensor instead (tensor parallel
    shards): only the sliced bytes are copied out of the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name, target in names:
                yield target, (f.get_tensor(name) if take is None else take(target, f.get_slice(name)))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read vision tensors from {path}: {e}") from e


def _progress_bar(total: int, enabled: bool):
    """A bar only on a terminal: in a log file or a pipe each redraw would be a line of
    noise, and the summary logged at the end says the same thing once."""
    from tqdm import tqdm

    show = enabled and sys.stderr.isatty()
    return tqdm(total=total, unit="tensor", desc="vision weights", file=sys.stderr, disable=not show, leave=False)


def load_vision_weights(
    ckpt_dir: str | Path,
    weight_prefixes: Sequence[tuple[str, str]],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    take: Callable[[str, Any], torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Read only the vision tensors of a local checkpoint.

    A tensor belongs to the vision part when its name starts with one of the
    ``(checkpoint_prefix, module_prefix)`` pairs (first match wins); it is
    returned under ``module_prefix + rest``. Every other tensor is never read,
    and shard files holding none of the vision tensors are never opened.
    Floating tensors are cast to ``dtype`` (when given) and moved to ``device``
    one at a time. Raises ``CheckpointError`` for a missing directory or
    config.json, unreadable files, no vision tensors, or two checkpoint names
    that map to the same module name. With ``take`` (``epd_encoder.tp.shard``) each
    tensor is ``take(module_name, safe_open(...).get_slice(name))``: a rank's slice.
    """
    if not weight_prefixes:
        raise CheckpointError("no weight prefixes given: cannot tell vision tensors apart")
    info = read_checkpoint(ckpt_dir)
    by_file: dict[str, list[tuple[str, str]]] = {}
    targets: dict[str, str] = {}
    for name in sorted(info.weight_map):
        target = _rename(name, weight_prefixes)
        if target is None:
            continue
        if target in targets:
            raise CheckpointError(
                f"checkpoint tensors {targets[target]!r} and {name!r} both map to {target!r}"
            )
        targets[target] = name
        by_file.setdefault(info.weight_map[name], []).append((name, target))
    if not targets:
        sample = ", ".join(sorted(info.weight_map)[:5])
        tried = ", ".join(repr(p) for p, _ in weight_prefixes)
        raise CheckpointError(
            f"no vision tensors in {info.path}: no name starts with {tried} (names look like: {sample})"
        )

    report = LoadReport(
        shards_opened=sorted(by_file),
        shards_skipped=[f for f in info.weight_files if f not in by_file],
    )
    state: dict[str, torch.Tensor] = {}
    digest = blake3(max_threads=blake3.AUTO)
    start = time.perf_counter()
    with _progress_bar(len(targets), progress) as bar:
        for file in report.shards_opened:
            for target, t in _read(info.path / file, by_file[file], take):
                report.bytes += t.numel() * t.element_size()
                digest.update(f"{target}|{t.dtype}|{tuple(t.shape)}|".encode())
                digest.update(memoryview(t.contiguous().view(torch.uint8).numpy()))
                cast = dtype if dtype is not None and t.is_floating_point() else None
                state[target] = t.to(device=device, dtype=cast)
                report.tensors += 1
                bar.update(1)
    report.digest = digest.hexdigest()
    logger.info(
        "loaded %d vision tensors (%.1f MiB) from %d of %d shards in %.2f s",
        report.tensors, report.bytes / (1 << 20), len(report.shards_opened),
        len(report.shards_opened) + len(report.shards_skipped), time.perf_counter() - start,
    )
    return state, report


def _names(kind: str, names: Sequence[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = f", ... ({len(names)} in all)" if len(names) > _NAMES_SHOWN else f" ({len(names)})"
    return f"{kind}: {shown}{more}"


def load_strict(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], *, assign: bool = False) -> None:
    """Load ``state_dict`` into ``module`` requiring an exact match.

    Missing keys, unexpected keys and shape mismatches raise ``CheckpointError``
    naming the first 20 of each and their count; nothing is loaded then.
    ``assign=True`` takes the tensors as they are (for modules built on meta).
    """
    expected = module.state_dict(keep_vars=True)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = sorted(
        f"{k} {tuple(state_dict[k].shape)} vs module {tuple(expected[k].shape)}"
        for k in set(expected) & set(state_dict)
        if tuple(state_dict[k].shape) != tuple(expected[k].shape)
    )
    problems = [
        _names(kind, names)
        for kind, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched))
        if names
    ]
    if problems:
        raise CheckpointError(
            f"checkpoint does not match {type(module).__name__}: " + "; ".join(problems)
        )
    module.load_state_dict(dict(state_dict), strict=True, assign=assign)
