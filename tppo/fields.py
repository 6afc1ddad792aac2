"""Declared field rules for config dataclasses: `spec(default, ge=..., choices=...)` and their check.

Shared by every package's config module so that a bad value always produces the same kind of message: the
dotted key, the value, and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
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
