"""The policy registry: `--policy NAME` to a `SchedulingPolicy` instance.

A spec is resolved in this order:

  1. a name registered with `@register` (the built-ins: fcfs, priority, sjf, edf, fair, lpm);
  2. an entry point name in the group `planserve.policies` (an installed plugin package
     declares `[project.entry-points."planserve.policies"] mine = "pkg.module:MyPolicy"`);
  3. a dotted path to a class, `package.module:ClassName` or `package.module.ClassName`
     (out-of-tree code that is importable but not installed as a plugin).

Anything else is a `ValueError` that lists the valid names.

Options: `create(spec, **options)` passes each policy the keyword options its constructor
takes. The scheduler offers every policy the same context (`SCHEDULER_OPTIONS`, e.g.
`prefix_match_len`); a policy that does not take one simply does not get it. Any other option
the policy does not take is a `TypeError` that names it, so a misspelt `--policy-option` fails
at start-up instead of being ignored.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from typing import Any

from scheduler_service.core.policies.base import POLICIES, SchedulingPolicy, register
from scheduler_service.registry import path_of

__all__ = [
    "ENTRY_POINT_GROUP",
    "SCHEDULER_OPTIONS",
    "SchedulingPolicy",
    "available",
    "create",
    "describe",
    "register",
    "resolve",
]

ENTRY_POINT_GROUP = POLICIES.entry_point_group

#: Options the scheduler passes to every policy; dropped for a policy that does not take them.
SCHEDULER_OPTIONS = frozenset({"prefix_match_len"})


def available() -> list[str]:
    """Every name `create` accepts (registered and entry points), sorted."""
    return POLICIES.available()


def resolve(spec: str) -> type[SchedulingPolicy]:
    """The policy class for a name, an entry point name or a dotted path."""
    if spec in POLICIES.classes:
        return POLICIES.classes[spec]
    entry_point = POLICIES.entry_points().get(spec)
    if entry_point is not None:
        return _checked(entry_point.load(), f"entry point {spec!r} ({entry_point.value})")
    if "." in spec or ":" in spec:
        return _checked(_import_dotted(spec), repr(spec))
    raise ValueError(f"unknown scheduling policy {spec!r}; {_valid_names()}")


def create(spec: str, **options: Any) -> SchedulingPolicy:
    """Builds the policy `spec` names, with the options its constructor takes."""
    cls = resolve(spec)
    return cls(**_fit_options(cls, options))


def describe() -> str:
    """One line per policy, for `--help`."""
    lines = []
    entry_points = POLICIES.entry_points()
    for name in available():
        try:
            cls = resolve(name)
            summary = (inspect.getdoc(cls) or "").partition("\n")[0] or path_of(cls)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break --help
            summary = f"(entry point {entry_points[name].value} failed to load: {exc})"
        lines.append(f"{name:<10} {summary}")
    return "\n".join(lines)


# ---- helpers ------------------------------------------------------------------------------


def _valid_names() -> str:
    return (
        "valid names: "
        + ", ".join(available())
        + "; or a dotted path such as package.module:ClassName"
    )


def _import_dotted(spec: str) -> Any:
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
    else:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"malformed policy path {spec!r}; {_valid_names()}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import policy {spec!r}: {exc}; {_valid_names()}") from exc
    obj: Any = module
    for part in attribute.split("."):  # allows module:Outer.Inner
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ValueError(f"cannot find policy {spec!r}: {exc}; {_valid_names()}") from exc
    return obj


def _checked(obj: Any, what: str) -> type[SchedulingPolicy]:
    if not (isinstance(obj, type) and issubclass(obj, SchedulingPolicy)):
        raise TypeError(f"policy {what} is {obj!r}, not a SchedulingPolicy subclass")
    return obj


def _fit_options(cls: type[SchedulingPolicy], options: dict[str, Any]) -> dict[str, Any]:
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: pass everything
        return options
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return options
    accepted = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }
    unknown = sorted(set(options) - accepted - SCHEDULER_OPTIONS)
    if unknown:
        takes = ", ".join(sorted(accepted - SCHEDULER_OPTIONS)) or "no options"
        raise TypeError(
            f"policy {cls.name or path_of(cls)!r} does not take "
            f"{', '.join(unknown)}; it takes: {takes}"
        )
    return {key: value for key, value in options.items() if key in accepted}


# The built-ins register themselves on import (with base.register).
from scheduler_service.core.policies import edf, fair, fcfs, lpm, priority, sjf  # noqa: E402,F401
