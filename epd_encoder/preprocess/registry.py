# SPDX-License-Identifier: Apache-2.0
"""Image preprocessors by checkpoint ``model_type``, and building one from a checkpoint or config.

Family modules are imported on first use and import ``base``, never the other
way round, so ``base`` stays the shared interface that every family builds on.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epd_encoder.errors import ConfigError, UnsupportedModel
from epd_encoder.preprocess.base import ImagePreprocessor

__all__ = ["load_preprocessor", "load_video_preprocessor", "supported_model_types"]

# model_type -> module exposing ``build_preprocessor(config, model_config, *, pixel_bounds, backend)``
_FAMILY_MODULES: dict[str, str] = {
    "qwen2_vl": "epd_encoder.preprocess.qwen",
    "qwen2_5_vl": "epd_encoder.preprocess.qwen",
    "qwen3_vl": "epd_encoder.preprocess.qwen",
    "qwen3_vl_moe": "epd_encoder.preprocess.qwen",
    "qwen3_5": "epd_encoder.preprocess.qwen",
    "qwen3_5_moe": "epd_encoder.preprocess.qwen",
    "kimi_k25": "epd_encoder.preprocess.kimi",
    "internvl": "epd_encoder.preprocess.internvl",
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_FAMILY_MODULES))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return value


def _nested(root: Path, key: str) -> dict[str, Any] | None:
    """``processor_config.json``'s ``key`` entry, as transformers v5 saves it; None when the
    file is absent or keeps only the processor's own settings (the pre-v5 layout)."""
    if not (root / "processor_config.json").is_file():
        return None
    nested = _read_json(root / "processor_config.json").get(key)
    return nested if isinstance(nested, dict) else None


def _from_checkpoint(root: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """transformers' order: ``processor_config.json``'s ``image_processor``, then
    ``preprocessor_config.json`` (what every Hub repository of these families has)."""
    model_config = _read_json(root / "config.json") if (root / "config.json").is_file() else None
    nested = _nested(root, "image_processor")
    if nested is not None:
        return nested, model_config
    if (root / "preprocessor_config.json").is_file():
        return _read_json(root / "preprocessor_config.json"), model_config
    raise ConfigError(f"{root} has neither preprocessor_config.json nor an image_processor in processor_config.json")


def load_preprocessor(
    source: "str | os.PathLike[str] | Mapping[str, Any]",
    model_type: str | None = None,
    *,
    model_config: Mapping[str, Any] | None = None,
    pixel_bounds: tuple[int, int] | None = None,
    backend: str = "torchvision",
) -> ImagePreprocessor:
    """Build the preprocessor for a checkpoint directory or a preprocessor config dict.

    A directory supplies the ``image_processor`` entry of ``processor_config.json`` or
    else ``preprocessor_config.json`` (transformers' order) and, when present, ``config.json``, from
    which ``model_type`` and ``model_config`` default. ``pixel_bounds`` is the
    range per-request ``min_pixels``/``max_pixels`` may take (Qwen families);
    by default the config's own values. ``backend`` is the transformers image-processor
    backend to equal: ``torchvision`` (what deployments run) or ``pil``. Raises
    ``UnsupportedModel`` or ``ConfigError``.
    """
    if isinstance(source, Mapping):
        config, found_model = dict(source), None
    else:
        root = Path(source)
        if not root.is_dir():
            raise ConfigError(f"{root} is not a checkpoint directory")
        config, found_model = _from_checkpoint(root)
    model_config = dict(model_config) if model_config is not None else found_model
    if model_type is None:
        model_type = (model_config or {}).get("model_type")
    if model_type is None:
        raise ConfigError("model_type is required when the source has no config.json")
    module_name = _FAMILY_MODULES.get(model_type)
    if module_name is None:
        raise UnsupportedModel(f"no image preprocessor for model_type {model_type!r}")
    build = importlib.import_module(module_name).build_preprocessor
    return build(config, model_config, pixel_bounds=pixel_bounds, backend=backend)


# model_type -> module exposing ``build_video_preprocessor(video_config, model_type, *, bounds)``.
# Families absent here (internvl, kimi_k25) have no video path.
_VIDEO_MODULES: dict[str, str] = {
    "qwen2_vl": "epd_encoder.preprocess.video",
    "qwen2_5_vl": "epd_encoder.preprocess.video",
    "qwen3_vl": "epd_encoder.preprocess.video",
    "qwen3_vl_moe": "epd_encoder.preprocess.video",
    "qwen3_5": "epd_encoder.preprocess.video",
    "qwen3_5_moe": "epd_encoder.preprocess.video",
}


def _video_config(root: Path) -> dict[str, Any] | None:
    """transformers' order: ``processor_config.json``'s ``video_processor``, then
    ``video_preprocessor_config.json``, then ``preprocessor_config.json`` (Qwen2.5-VL
    ships only that one); ``None`` when there is none (the class defaults)."""
    nested = _nested(root, "video_processor")
    if nested is not None:
        return nested
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (root / name).is_file():
            return _read_json(root / name)
    return None


def load_video_preprocessor(
    source: "str | os.PathLike[str] | Mapping[str, Any]",
    model_type: str | None = None,
    *,
    bounds: Any = None,
) -> Any:
    """The video preprocessor for a checkpoint directory or a video processor config dict.

    ``model_type`` defaults to the directory's ``config.json``. ``bounds`` is a
    ``video.VideoBounds`` (what requests may ask for). Raises ``UnsupportedModel``
    for families without video, or ``ConfigError``.
    """
    if isinstance(source, Mapping):
        config: dict[str, Any] | None = dict(source)
    else:
        root = Path(source)
        if not root.is_dir():
            raise ConfigError(f"{root} is not a checkpoint directory")
        config = _video_config(root)
        if model_type is None and (root / "config.json").is_file():
            model_type = _read_json(root / "config.json").get("model_type")
    if model_type is None:
        raise ConfigError("model_type is required when the source has no config.json")
    module_name = _VIDEO_MODULES.get(model_type)
    if module_name is None:
        raise UnsupportedModel(f"no video preprocessor for model_type {model_type!r}")
    build = importlib.import_module(module_name).build_video_preprocessor
    return build(config, model_type, bounds=bounds)
