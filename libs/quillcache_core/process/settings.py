"""Frozen settings objects from CLI flags and QC_* environment variables.

Each service declares one frozen dataclass; every field has a default and a `help`
in its metadata. `load_settings` builds the argparse parser from the fields, so
`--help` always lists exactly what the code reads. Precedence: CLI > env > default.
Field `lease_ttl_s` is flag `--lease-ttl-s` and variable `QC_LEASE_TTL_S`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from quillcache_core.errors import InvalidArgument

T = TypeVar("T")


def opt(default: Any, help: str, choices: Sequence[str] | None = None) -> Any:
    """A settings field with its help text (and allowed values)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def _base_type(annotation: Any) -> type:
    if isinstance(annotation, str):
        annotation = eval(annotation, {}, {})  # noqa: S307 - our own annotations only
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    return annotation


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _converter(kind: type):
    if kind is bool:
        return _parse_bool
    return kind


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    env: Mapping[str, str] | None = None,
) -> T:
    """Parse `argv` and `env` (default os.environ) into `cls`; exits 2 on a bad value."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    for f in fields:
        kind = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        env_name = "QC_" + f.name.upper()
        help_text = f"{f.metadata.get('help', '')} [env {env_name}]"
        parser.add_argument(
            flag,
            dest=f.name,
            type=_converter(kind),
            default=argparse.SUPPRESS,
            choices=f.metadata.get("choices"),
            metavar=f.name.upper() if kind is not bool else "BOOL",
            help=help_text + f" (default: {f.default!r})",
            # A bool flag alone means true (`--insecure`); `--flag false` still works.
            **({"nargs": "?", "const": True} if kind is bool else {}),
        )
    args = vars(parser.parse_args(list(argv) if argv is not None else None))
    values: dict[str, Any] = {}
    for f in fields:
        if f.name in args:
            values[f.name] = args[f.name]
            continue
        env_name = "QC_" + f.name.upper()
        if env_name in env:
            kind = _base_type(hints[f.name])
            try:
                value = _converter(kind)(env[env_name])
            except ValueError as exc:
                parser.error(f"{env_name}: {exc}")
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                parser.error(f"{env_name}: {value!r} is not one of {', '.join(choices)}")
            values[f.name] = value
    try:
        return cls(**values)
    except InvalidArgument as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
