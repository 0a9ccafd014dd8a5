"""A config field declared once: its default, its bound and its flag; its help is its docstring.

    port: int = setting(50051, low=0, high=65535)
    \"\"\"Port of the public API; 0 picks a free one (printed at start).\"\"\"

`check_bounds(config)` checks every declared bound (ValueError naming the field, the bound and
the value); `add_flags` makes the argparse flags of a config class from its fields, and
`from_args` the config back from the parsed flags. So the CLI, the validation and the help can
never drift apart (vLLM builds its CLI from EngineArgs the same way). A class without
`setting`s (the model service's config, read from outside by tools/cli.py) gets flags by its
field names, types and docstrings alone.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Callable, Optional, Sequence

_KEY = "planserve.setting"
_UNSET: Any = object()  # no cli_default: the flag defaults to the field's default


@dataclasses.dataclass(frozen=True)
class Bound:
    """What one field may hold, and how it is spelled on the command line."""

    low: Optional[float] = None  # inclusive
    high: Optional[float] = None  # inclusive
    above: Optional[float] = None  # exclusive lower bound
    choices: Optional[Sequence[str]] = None
    flag: Optional[str] = None  # the flag's name, when not the field's with dashes
    cli: bool = True  # False: a library setting only, no flag
    cli_default: Any = _UNSET  # the flag's default, when not the field's


def setting(default: Any, **bound: Any) -> Any:
    """A dataclass field with a default and a `Bound` (keywords of Bound)."""
    return dataclasses.field(default=default, metadata={_KEY: Bound(**bound)})


def bound_of(field: dataclasses.Field) -> Bound:
    return field.metadata.get(_KEY, Bound())


def check_bounds(config: Any) -> None:
    """Raises ValueError for the first field outside its declared bound."""
    for field in dataclasses.fields(config):
        bound, value, name = bound_of(field), getattr(config, field.name), field.name
        if bound.choices is not None and value not in bound.choices:
            raise ValueError(f"{name} must be one of {', '.join(bound.choices)}, got {value!r}")
        if bound.low is not None and bound.high is not None:
            if not bound.low <= value <= bound.high:
                raise ValueError(f"{name} must be in [{bound.low}, {bound.high}], got {value}")
        elif bound.low is not None and not value >= bound.low:
            raise ValueError(f"{name} must be >= {bound.low}, got {value}")
        if bound.above is not None and not value > bound.above:
            raise ValueError(f"{name} must be > {bound.above}, got {value}")


def docstrings(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source), one paragraph."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _value_type(cls: type, field: dataclasses.Field) -> Callable[[str], Any]:
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint  # Optional[int] -> int


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    only: Optional[Sequence[str]] = None,
    skip: Sequence[str] = (),
    flag_names: Optional[dict[str, str]] = None,
    types: Optional[dict[str, Callable[[str], Any]]] = None,
    helps: Optional[dict[str, str]] = None,
    defaults_none: bool = False,
) -> None:
    """One flag per field of `cls` that has one (`only`: these fields alone, `skip`: but not
    these). `flag_names`/`types` rename or retype a field's flag; `helps` adds to its help.
    `defaults_none`: every flag defaults to None, so that the caller passes on only what was
    given (the model service's flags, passed on by `planserve serve`)."""
    docs = docstrings(cls)
    for field in dataclasses.fields(cls):
        bound = bound_of(field)
        if not bound.cli or field.name in skip or (only is not None and field.name not in only):
            continue
        name = (flag_names or {}).get(field.name) or bound.flag or field.name.replace("_", "-")
        default = field.default if bound.cli_default is _UNSET else bound.cli_default
        text = docs.get(field.name, "") + (helps or {}).get(field.name, "")
        if not isinstance(field.default, bool) and default is not dataclasses.MISSING:
            shown = "none" if default is None or default == "" else default
            text += f" (default: {shown})"  # --help shows every default
        kwargs: dict[str, Any] = {"dest": field.name, "help": text.replace("%", "%%")}
        if isinstance(field.default, bool):
            # A flag turns a setting on (store_true) or, spelled no-..., off (store_false).
            kwargs["action"] = "store_false" if field.default else "store_true"
        else:
            kwargs["type"] = (types or {}).get(field.name) or _value_type(cls, field)
            kwargs["default"] = None if defaults_none else default
            kwargs["metavar"] = name.upper().replace("-", "_")
            if bound.choices is not None:
                kwargs["choices"] = list(bound.choices)
        parser.add_argument("--" + name, **kwargs)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The config the parsed flags describe (fields without a flag keep their defaults)."""
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
    }
    return cls(**{**given, **overrides})
