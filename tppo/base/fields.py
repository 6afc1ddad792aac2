"""Declared field rules for config dataclasses: `spec(default, ge=..., choices=...)` and their check.

Shared by every package's config module so that a bad value always produces the same kind of message: the
dotted key, the value, and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is out of range, of the wrong kind, or inconsistent with another one."""


def spec(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[Any, ...] | None = None,
    help: str = "",
) -> Any:
    """A dataclass field whose allowed values are declared beside it (checked by `check_fields`)."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "help": help}
    return field(default=default, metadata=meta)


def _allowed(meta: dataclasses.Field) -> str:
    m = meta.metadata
    if m.get("choices") is not None:
        return "one of " + ", ".join(repr(c) for c in m["choices"])
    parts = [
        f"{op} {m[key]}"
        for key, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
        if m.get(key) is not None
    ]
    return "a value " + " and ".join(parts)


def _violates(value: Any, m: dict[str, Any]) -> bool:
    if value is None:
        return False
    if m.get("choices") is not None:
        return value not in m["choices"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, float) and math.isnan(value):
        return True
    return (
        (m.get("ge") is not None and value < m["ge"])
        or (m.get("gt") is not None and value <= m["gt"])
        or (m.get("le") is not None and value > m["le"])
        or (m.get("lt") is not None and value >= m["lt"])
    )


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check every field declared with `spec` on `obj` and its nested dataclasses; raise ConfigError naming the key."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_fields(value, key + ".")
        elif f.metadata and _violates(value, f.metadata):
            raise ConfigError(f"{key}={value!r} is not allowed: expected {_allowed(f)}")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_as(current: Any, raw: str) -> Any:
    """`raw` read as the type of the field's current value (bool, int, float; str otherwise)."""
    if isinstance(current, bool):
        if raw.lower() not in _TRUE + _FALSE:
            raise ValueError(f"expected true or false, got {raw!r}")
        return raw.lower() in _TRUE
    for kind, name in ((int, "an integer"), (float, "a number")):
        if isinstance(current, kind):
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"expected {name}, got {raw!r}") from None
    return raw


def with_assignments(
    obj: Any, assignments: Sequence[str], flag: str, reserved: Mapping[str, str] = {}
) -> Any:
    """A copy of dataclass `obj` with command-line `KEY=VALUE` assignments applied, each VALUE read as its field's
    type; ValueError naming `flag`, the item and the problem otherwise. `reserved` maps a field to the option that
    sets it instead (the item is refused with that hint). The copy runs the class's own checks (`__post_init__`);
    `check_fields` is the caller's, where the class declares `spec` rules."""
    names = {f.name for f in dataclasses.fields(obj)}
    changes = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        if key in reserved:
            raise ValueError(f"{flag} {key}: set it with {reserved[key]}")
        if key not in names:
            raise ValueError(
                f"{flag} {key}: not a field, expected one of {', '.join(sorted(names - set(reserved)))}"
            )
        try:
            changes[key] = _parse_as(getattr(obj, key), raw)
        except ValueError as err:
            raise ValueError(f"{flag} {key}: {err}") from None
    return dataclasses.replace(obj, **changes)
