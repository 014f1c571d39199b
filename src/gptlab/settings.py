"""The machinery behind config.py's typed settings: fields with their help, checks that raise GptlabError, the
types of fields, command-line text parsed into them, dataclasses built from presets and overrides and from JSON."""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import field, fields
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from gptlab.errors import GptlabError

_D = TypeVar("_D")  # a settings dataclass


def check(ok: bool, message: str) -> None:
    if not ok:
        raise GptlabError(message)


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    check(value in choices, f"{name} must be one of {', '.join(choices)}, not {value!r}")


def check_types(obj: Any) -> None:
    """Every field holds a value of its declared type (settings also come from hand-edited JSON), and every
    number is finite: NaN passes every comparison-based check below and would poison a run silently."""
    for name, kind in field_types(type(obj)).items():
        value = getattr(obj, name)
        if value is None:
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            setattr(obj, name, value)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool)) if isinstance(kind, type) \
            else isinstance(value, list) and all(isinstance(v, str) for v in value)
        if not ok:
            what = {int: "an integer", float: "a number", bool: "true or false", str: "text"}.get(kind,
                                                                                                 "a list of text")
            raise GptlabError(f"{name} must be {what}, not {value!r}")
        if kind is float:
            check(math.isfinite(value), f"{name} must be a finite number, not {value}")


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None, metavar: str | None = None) -> Any:
    """A dataclass field with the one-line help (and the fixed set of values, if any, and the name its value goes
    by, if not its type's) that `--help` shows."""
    meta = {"help": help, "choices": choices, "metavar": metavar}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def field_help(cls: type) -> dict[str, tuple[str, tuple[str, ...] | None, str | None]]:
    """Field name -> (help text, choices or None, the name its value goes by in --help or None)."""
    return {f.name: (f.metadata.get("help", ""), f.metadata.get("choices"), f.metadata.get("metavar"))
            for f in fields(cls)}


def field_types(cls: type) -> dict[str, type]:
    """Field name -> its Python type (X for an optional `X | None`), for building CLI flags and parsing overrides."""
    hints = get_type_hints(cls)
    return {f.name: _required(hints[f.name]) for f in fields(cls)}


def _required(kind: Any) -> Any:
    """X for `X | None`, else `kind` unchanged."""
    if get_origin(kind) in (Union, types.UnionType):
        rest = [a for a in get_args(kind) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return kind


def parse_value(cls: type, name: str, text: str) -> bool | int | float | str:
    """Turn the command-line text for field `name` of dataclass `cls` into a value of the field's type."""
    kind = field_types(cls)[name]
    if kind is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise GptlabError(f"{name} must be true or false, not {text!r}")
    if kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            raise GptlabError(f"{name} must be {'an integer' if kind is int else 'a number'}, not {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise GptlabError(f"{name} must be a finite number, not {text!r}")
        return value
    return text


def build(cls: type[_D], base: dict[str, Any], overrides: dict[str, Any]) -> _D:
    """An instance of dataclass `cls` from preset values updated with overrides; validates once."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(base) - names) + sorted(set(overrides) - names)
    if unknown:
        raise GptlabError(f"unknown setting {unknown[0]!r} for {cls.__name__}; known: {', '.join(sorted(names))}")
    return cls(**{**base, **overrides})


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def from_dict(cls: type[_D], data: dict[str, Any]) -> _D:
    """Rebuild a dataclass from JSON, ignoring keys newer versions may have added."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})

