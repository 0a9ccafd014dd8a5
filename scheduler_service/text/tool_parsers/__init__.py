"""Tool-call parsers: `--tool-call-parser NAME` to the parser of a model family's call format.

A name is resolved in this order, as the scheduling policies are (core/policies):
  1. a built-in: hermes, llama3_json, mistral, pythonic;
  2. an entry point name in the group `planserve.tool_parsers` (an installed plugin package
     declares `[project.entry-points."planserve.tool_parsers"] mine = "pkg.module:MyParser"`);
  3. a dotted path to a ToolParser subclass, `package.module:ClassName`.
Anything else is a ValueError listing the valid names.
"""

from __future__ import annotations

import importlib
from typing import Any

from scheduler_service.text.tool_parsers import hermes, llama3_json, mistral, pythonic
from scheduler_service.text.tool_parsers.base import (
    TOOL_PARSERS,
    Parsed,
    ToolCall,
    ToolParser,
    register,
)

__all__ = ["Parsed", "ToolCall", "ToolParser", "available", "create", "register"]
_BUILT_IN = (hermes, llama3_json, mistral, pythonic)  # imported for their @register


def available() -> list[str]:
    return TOOL_PARSERS.available()


def _checked(obj: Any, what: str) -> type[ToolParser]:
    if not (isinstance(obj, type) and issubclass(obj, ToolParser)):
        raise ValueError(f"tool parser {what} is {obj!r}, not a ToolParser subclass")
    return obj


def resolve(spec: str) -> type[ToolParser]:
    """The parser class for a name, an entry point name or a dotted path."""
    if spec in TOOL_PARSERS.classes:
        return TOOL_PARSERS.classes[spec]
    entry_point = TOOL_PARSERS.entry_points().get(spec)
    if entry_point is not None:
        return _checked(entry_point.load(), f"entry point {spec!r} ({entry_point.value})")
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"cannot import tool parser {spec!r}: {error}") from None
        return _checked(obj, repr(spec))
    raise ValueError(
        f"unknown tool parser {spec!r}; valid: {', '.join(available())} "
        "(or an entry point of planserve.tool_parsers, or package.module:Class)"
    )


def create(spec: str) -> ToolParser:
    return resolve(spec)()
