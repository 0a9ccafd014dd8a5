"""Plugins by name, for the scheduling policies (core/policies) and the replica scorers
(engine/scorers): classes registered with `@register` under their `name`, and the entry points
of an installed package's group. Each package resolves a name with it and words its own errors
(a policy may also be a dotted path; a scorer too)."""

from __future__ import annotations

import importlib.metadata
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


def path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


class Registry(Generic[T]):
    def __init__(self, kind: str, base: type, entry_point_group: str):
        self.kind = kind  # "policy", "scorer": how errors name what is registered
        self.base = base
        self.entry_point_group = entry_point_group
        self.classes: dict[str, T] = {}

    def register(self, cls: T) -> T:
        """Class decorator: registers a subclass of `base` under `cls.name`."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{cls!r} is not a {self.base.__name__} subclass")
        name = getattr(cls, "name", "")
        if not name:
            raise ValueError(f"{cls.__qualname__} has no `name`")
        existing = self.classes.get(name)
        if existing is not None and existing is not cls:
            taken = f"{self.kind} name {name!r} is already taken by {path_of(existing)}"
            raise ValueError(taken)
        self.classes[name] = cls
        return cls

    def entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        group = importlib.metadata.entry_points(group=self.entry_point_group)
        return {ep.name: ep for ep in group}

    def available(self) -> list[str]:
        """Every registered and entry point name, sorted."""
        return sorted(set(self.classes) | set(self.entry_points()))
