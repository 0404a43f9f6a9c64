# SPDX-License-Identifier: Apache-2.0
"""The config tree's building blocks: leaves with their help text, sections, range checks."""

from __future__ import annotations

from dataclasses import field
from typing import Any

MiB = 1 << 20


def opt(default: Any, help: str, **extra: Any) -> Any:
    """A config leaf: its default and the trade-off it controls."""
    return field(default=default, metadata={"help": help, **extra})


def sub(cls: type) -> Any:
    return field(default_factory=cls)


def _positive(obj: Any, *names: str, minimum: float = 0, strict: bool = True) -> None:
    """Refuse a leaf out of range, naming it as its flag (what the operator typed)."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum or (strict and value == minimum):
            raise ValueError(f"--{name.replace('_', '-')} must be {'>' if strict else '>='} {minimum:g}, "
                             f"got {value}")


def _non_negative(obj: Any, *names: str) -> None:
    _positive(obj, *names, strict=False)
