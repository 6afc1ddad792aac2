"""Name -> function registries, so that recipes select estimators, losses, planners and rewards by config.

ADVANTAGES = Registry("advantage estimator")

@ADVANTAGES.register("egae")
def egae(...): ...

ADVANTAGES.get("egae")   # unknown names raise KeyError listing the registered ones
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of implementations of one kind (what `kind` says in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._table: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._table and self._table[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._table[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        try:
            return self._table[name]
        except KeyError:
            known = ", ".join(sorted(self._table)) or "none"
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._table))
