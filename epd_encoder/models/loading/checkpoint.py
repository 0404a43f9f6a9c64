# SPDX-License-Identifier: Apache-2.0
"""What a local checkpoint directory holds, read without touching any weights."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epd_encoder.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory as described by its JSON files and safetensors headers.

    ``weight_map`` maps every tensor name to the file (relative to ``path``)
    holding it, for the sharded and the single-file layout alike. ``sharded``
    is true when it came from ``model.safetensors.index.json``. The processor configs are
    read by ``preprocess/registry.py`` alone, in transformers' order.
    """

    path: Path
    config: dict[str, Any]
    weight_map: dict[str, str] = field(repr=False)
    sharded: bool

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def weight_files(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.weight_map.values())))

    def hf_config(self):
        """The transformers config object (``AutoConfig.from_pretrained``)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {what} {path}: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} is not a JSON object")
    return data


def read_weight_map(ckpt_dir: str | Path) -> tuple[dict[str, str], bool]:
    """``(tensor name -> file, sharded)`` from the index, or from the single file's header."""
    root = Path(ckpt_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        return {str(k): str(v) for k, v in weight_map.items()}, True
    single = root / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(single, "pt") as f:
                return {k: SINGLE_FILE for k in f.keys()}, False
        except Exception as e:
            raise CheckpointError(f"cannot read safetensors header of {single}: {e}") from e
    present = sorted(p.name for p in root.glob("*.safetensors"))
    hint = f" (found {', '.join(present[:5])} without {INDEX_FILE})" if present else ""
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}{hint}")


def read_checkpoint(ckpt_dir: str | Path) -> CheckpointInfo:
    """Read config.json and the weight map."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{root} has no config.json: not a Hugging Face checkpoint")
    config = _read_json(config_file, "config")
    weight_map, sharded = read_weight_map(root)
    return CheckpointInfo(root, config, weight_map, sharded)
