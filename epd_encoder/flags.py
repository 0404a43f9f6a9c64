# SPDX-License-Identifier: Apache-2.0
"""The config tree (epd_encoder/config/) as flags, environment variables and TOML keys.

Every leaf of the tree is one setting with three spellings, generated here and
nowhere else: the flag ``--max-batch-cost``, the environment variable
``EPD_ENCODER_MAX_BATCH_COST`` and the TOML key ``max-batch-cost`` (flat: flag
names are unique across the tree and are the public interface; the tree's
grouping is internal and may move). Sources merge in one order, later winning:
defaults < TOML file (``--config``) < environment < command line. This module
is the one place the environment is read (``EPD_ENCODER_CACHE``, the tiny-model
cache directory, included: ``cache_root``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, get_args, get_origin

ENV_PREFIX = "EPD_ENCODER_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"  # the --config file
CACHE_ENV = ENV_PREFIX + "CACHE"  # the tiny-model cache directory; not a serve flag
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class FlagError(ValueError):
    """A setting that cannot be used; the message names the flag and where the value came from."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a parse error leads with the error, then says where help is: argparse
    prints the usage first, which for ``serve`` is a screenful that hides the one line that matters."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for the flags.\n")


def cache_root() -> Path:
    """Root of the tiny-model cache: ``$EPD_ENCODER_CACHE``, else ``~/.cache/epd-encoder``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "epd-encoder")


@dataclass(frozen=True)
class Leaf:
    path: tuple[str, ...]
    field: dataclasses.Field
    kind: type  # int, float, str or bool
    choices: tuple | None
    many: bool = False  # tuple[str, ...]: a repeatable flag, comma-separated in the environment

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:  # the TOML key
        return self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def dest(self) -> str:
        return "__".join(self.path)

    @property
    def section(self) -> str:
        return ".".join(self.path[:-1]) or "general"

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def metavar(self) -> str:
        if self.choices:
            return "{" + ",".join(map(str, self.choices)) + "}"
        return self.field.metadata.get("metavar", self.name.upper())

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    def from_text(self, raw: str, where: str) -> Any:
        """An environment value, converted as the flag's own would be."""
        text = raw.strip()
        if self.many:
            return tuple(self._choose(self.kind(v.strip()), where) for v in text.split(",") if v.strip())
        if self.kind is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise FlagError(f"{where}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
        try:
            value = self.kind(text)
        except ValueError:
            raise FlagError(f"{where}={raw!r}: invalid {self.kind.__name__} value") from None
        return self._choose(value, where)

    def from_toml(self, value: Any, where: str) -> Any:
        if self.many:
            if not isinstance(value, list) or not all(isinstance(v, self.kind) for v in value):
                raise FlagError(f"{where} = {value!r}: expected a list of {self.kind.__name__}")
            return tuple(value)
        ok = (isinstance(value, bool) if self.kind is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) if self.kind is float else
              isinstance(value, self.kind) and not isinstance(value, bool))
        if not ok:
            raise FlagError(f"{where} = {value!r}: expected {self.kind.__name__}")
        return self._choose(self.kind(value), where)

    def _choose(self, value: Any, where: str) -> Any:
        if self.choices and value not in self.choices:
            raise FlagError(f"{where}: {value!r} is not one of {', '.join(map(str, self.choices))}")
        return value


def leaves(cls: type, path: tuple[str, ...] = ()) -> typing.Iterator[Leaf]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from leaves(hint, path + (f.name,))
            continue
        choices = get_args(hint) if get_origin(hint) is Literal else None
        if get_origin(hint) is tuple:  # tuple[str, ...]
            yield Leaf(path + (f.name,), f, get_args(hint)[0], None, many=True)
            continue
        kind = str if choices else ([a for a in get_args(hint) if a is not type(None)] or [hint])[0]
        yield Leaf(path + (f.name,), f, kind, choices)


def show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "unset" if value is None else str(value)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per leaf, grouped by sub-config. Flags default to SUPPRESS, so the parsed
    namespace holds only what the command line set and ``resolve`` can layer the rest."""
    groups: dict[str, Any] = {}
    for leaf in leaves(cls):
        group = groups.get(leaf.section) or groups.setdefault(leaf.section, parser.add_argument_group(leaf.section))
        text = f"{leaf.help} (default: {show(leaf.default)}) [env: {leaf.env}]".replace("%", "%%")
        if leaf.kind is bool:
            group.add_argument(leaf.flag, dest=leaf.dest, default=argparse.SUPPRESS,
                               action=argparse.BooleanOptionalAction, help=text)
        elif leaf.many:
            group.add_argument(leaf.flag, dest=leaf.dest, type=leaf.kind, default=argparse.SUPPRESS,
                               action="append", metavar=leaf.metavar, help=text)
        else:
            group.add_argument(leaf.flag, dest=leaf.dest, type=leaf.kind, choices=leaf.choices,
                               default=argparse.SUPPRESS, metavar=leaf.metavar, help=text)


def build(cls: type, values: Mapping[str, Any], path: tuple[str, ...] = ()) -> Any:
    """The frozen tree from ``dest -> value``; a missing leaf keeps its default."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values, path + (f.name,))
        elif "__".join(path + (f.name,)) in values:
            value = values["__".join(path + (f.name,))]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value  # an appended flag
    return cls(**kwargs)  # validation runs in __post_init__


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """The tree from the command line alone (defaults elsewhere)."""
    return build(cls, vars(ns))


def read_toml(path: str | Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise FlagError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise FlagError(f"--config {path}: not valid TOML: {e}") from None


def resolve(cls: type, ns: argparse.Namespace, config_file: str | None = None,
            environ: Mapping[str, str] | None = None) -> tuple[Any, list[str]]:
    """The tree from defaults < TOML file < environment < command line, and warnings
    (unknown ``EPD_ENCODER_*`` variables: a typo must not pass silently)."""
    environ = os.environ if environ is None else environ
    all_leaves = list(leaves(cls))
    by_key = {leaf.key: leaf for leaf in all_leaves}
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    config_file = config_file or environ.get(CONFIG_ENV) or None
    if config_file:
        seen: dict[str, str] = {}
        for key, value in read_toml(config_file).items():
            leaf = by_key.get(key.replace("_", "-"))
            if leaf is None:
                hint = (" (sections are not used: write flat keys named like the flags, "
                        "e.g. max-batch-cost = 16384)" if isinstance(value, dict) else "")
                raise FlagError(f"--config {config_file}: unknown key {key!r}{hint}")
            if leaf.key in seen:
                raise FlagError(f"--config {config_file}: {key!r} and {seen[leaf.key]!r} are the same setting")
            seen[leaf.key] = key
            values[leaf.dest] = leaf.from_toml(value, f"{config_file}: {key}")
            source[leaf.flag] = f"from {config_file}"
    for leaf in all_leaves:
        raw = environ.get(leaf.env)
        if raw is not None and raw.strip() != "":  # empty counts as unset (templated manifests)
            values[leaf.dest] = leaf.from_text(raw, leaf.env)
            source[leaf.flag] = f"from {leaf.env}"
    known = {leaf.env for leaf in all_leaves} | {CONFIG_ENV, CACHE_ENV}
    warnings = [f"ignoring unknown environment variable {name}" for name in sorted(environ)
                if name.startswith(ENV_PREFIX) and name not in known]
    for leaf in all_leaves:
        if hasattr(ns, leaf.dest):
            values[leaf.dest] = getattr(ns, leaf.dest)
            source.pop(leaf.flag, None)
    try:
        return build(cls, values), warnings
    except ValueError as e:  # say where a value that is not the command line's came from
        message = str(e)
        named = [f"{flag} {source[flag]}" for flag in dict.fromkeys(re.findall(r"--[a-z0-9-]+", message))
                 if flag in source]
        raise FlagError(message + (f" ({'; '.join(named)})" if named else "")) from None


def markdown(cls: type, prog: str) -> str:
    """The flag reference (docs/flags.md), generated from the tree."""
    out = [f"# `{prog}` flags", "",
           f"Generated from `epd_encoder/config/` by `epd-encoder flags --markdown`; do not edit by hand",
           "(`tests/test_cli.py` fails when this file is stale). Every flag can also be set by its",
           "environment variable or by its key in a TOML file given with `--config FILE` (or",
           f"`{CONFIG_ENV}`); later sources win: defaults < TOML file < environment < command line.",
           "See docs/operations.md, \"Configuration\"."]
    section = None
    for leaf in leaves(cls):
        if leaf.section != section:
            section = leaf.section
            out += ["", f"## {section}", "", "| flag | environment variable | default | what it controls |",
                    "| --- | --- | --- | --- |"]
        flag = f"`{leaf.flag}`" if leaf.kind is bool else f"`{leaf.flag} {leaf.metavar}`"
        if leaf.kind is bool:
            flag += f", `--no-{leaf.key}`"
        text = leaf.help.replace("|", "\\|")
        out.append(f"| {flag} | `{leaf.env}` | {show(leaf.default)} | {text} |")
    return "\n".join(out) + "\n"
