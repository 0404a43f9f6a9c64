# SPDX-License-Identifier: Apache-2.0
"""Model families by checkpoint ``model_type``, and loading a vision model from a directory.

Family modules are imported on first use, so a family's code (and its
transformers imports) costs nothing unless a checkpoint of that type is served.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epd_encoder.errors import CheckpointError, ConfigError, UnsupportedModel
from epd_encoder.models.base import VisionFamily

# model_type -> module exposing ``FAMILY: VisionFamily``
_FAMILY_MODULES: dict[str, str] = {
    "qwen2_vl": "epd_encoder.models.towers.qwen2_vl",
    "qwen2_5_vl": "epd_encoder.models.towers.qwen2_5_vl",
    "qwen3_vl": "epd_encoder.models.towers.qwen3_vl",
    "qwen3_vl_moe": "epd_encoder.models.towers.qwen3_vl",
    "qwen3_5": "epd_encoder.models.towers.qwen3_vl",
    "qwen3_5_moe": "epd_encoder.models.towers.qwen3_vl",
    "internvl": "epd_encoder.models.towers.internvl",
    "kimi_k25": "epd_encoder.models.towers.kimi_k25",
}

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_FAMILY_MODULES))


def get_family(model_type: str) -> VisionFamily:
    """The family serving checkpoints of ``model_type``; ``UnsupportedModel`` lists the others."""
    module_name = _FAMILY_MODULES.get(model_type)
    if module_name is None:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    try:
        family = importlib.import_module(module_name).FAMILY
    except (ImportError, AttributeError) as e:
        raise UnsupportedModel(f"model_type {model_type!r}: family module {module_name} unavailable") from e
    if model_type not in family.model_types:
        raise ConfigError(f"family {family.name} does not declare model_type {model_type!r}")
    return family


def resolve_dtype(dtype: Any, device: torch.device | str) -> torch.dtype:
    """``None``/``"auto"``: bf16 on CUDA when supported (else fp16), fp32 elsewhere."""
    device = torch.device(device)
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError as e:
        raise ConfigError(f"unsupported dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}") from e


@dataclass(frozen=True)
class LoadedVisionModel:
    """A vision tower ready to serve: eval mode, on ``device``, in ``dtype``."""

    family: VisionFamily
    hf_config: Any
    tower: torch.nn.Module
    model_id: str
    dtype: torch.dtype
    device: torch.device
    weights_digest: str = ""  # blake3 of the vision tensors read (LoadReport.digest)


def read_family(path: Path) -> tuple[VisionFamily, Any]:
    """The checkpoint's ``(family, transformers config)``; an unreadable config is a
    ``CheckpointError``, an unknown ``model_type`` the registry's ``ConfigError``."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the config of {path}: {e}") from e
    return get_family(getattr(config, "model_type", "")), config


def load_vision_model(
    ckpt_dir: str | Path,
    *,
    dtype: Any = None,
    device: str | torch.device = "cpu",
    model_id: str | None = None,
    progress: bool = True,
    tower: str = "fast",
) -> LoadedVisionModel:
    """Build the family's tower from ``config.json`` and load only its vision tensors, strictly.

    ``model_id`` defaults to the checkpoint directory's name. The tower is built
    on the meta device and takes the loaded tensors as they are, so no random
    initialization or second copy of the weights is ever made.
    """
    from epd_encoder.models.loading.loader import load_strict, load_vision_weights

    path = Path(ckpt_dir)
    device = torch.device(device)
    resolved = resolve_dtype(dtype, device)
    family, config = read_family(path)
    state, report = load_vision_weights(path, family.weight_prefixes, dtype=resolved, device=device,
                                        progress=progress)
    if tower not in ("fast", "reference"):
        raise ConfigError(f"tower must be 'fast' or 'reference', got {tower!r}")
    if tower == "reference":
        from epd_encoder.models.reference import ReferenceTower

        # Built for real, not on meta: transformers computes non-persistent buffers
        # (rotary tables) at init, and they are not in the checkpoint.
        tower = ReferenceTower(family, config)
        load_strict(tower.inner, state)
    else:
        with torch.device("meta"):
            tower = family.build_tower(config)
        load_strict(tower, state, assign=True)
    # A buffer built at init is not in the checkpoint and would still be on meta.
    left = [n for n, t in [*tower.named_parameters(), *tower.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{family.name}: tensors not provided by {path}: {', '.join(left[:10])}")
    tower = tower.to(device=device, dtype=resolved).eval()
    return LoadedVisionModel(family, config, tower, model_id or path.resolve().name, resolved, device,
                             report.digest)
