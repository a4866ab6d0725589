"""A name -> function registry, so configs select algorithms by name (as verl's core_algos does)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions of one kind (advantage estimators, loss aggregations, ...) by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._functions: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorate(function: F) -> F:
            if name in self._functions:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._functions[name] = function
            return function

        return decorate

    def get(self, name: str) -> F:
        try:
            return self._functions[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of {sorted(self._functions)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._functions

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._functions))
