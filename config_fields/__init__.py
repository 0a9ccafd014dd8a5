"""A config field declared once: its default, its bound and its flag; its help is its docstring.

    port: int = setting(50051, low=0, high=65535)
    \"\"\"Port of the public API; 0 picks a free one (printed at start).\"\"\"

`check_bounds(config)` checks every declared bound (ValueError naming the field, the bound and
the value, in the config's `Wording`); `add_flags` makes the argparse flags of a config class
from its fields, and `from_args` the config back from the parsed flags. So the CLI, the
validation and the help can never drift apart (vLLM builds its CLI from EngineArgs the same
way). Both services declare their configs with it (scheduler_service/config.py,
model_service/config.py), so it imports neither of them, nor anything heavy.
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
    aliases: tuple[str, ...] = ()  # more names of the flag (an older spelling)
    parse: Optional[Callable[[str], Any]] = None  # the flag's text -> value, when not the type's
    note: str = ""  # said after the bound when a value is outside it: "(block 0 is reserved)"
    nargs: Optional[str] = None  # a flag taking several values ("+"): a tuple field

    def rule(self) -> Optional[str]:
        """The range as words ("in [1, 1024]", "in (0, 1]", ">= 1", "> 0"); None if none."""
        if self.high is not None and self.low is not None:
            return f"in [{self.low}, {self.high}]"
        if self.high is not None and self.above is not None:
            return f"in ({self.above}, {self.high}]"
        if self.low is not None:
            return f">= {self.low}"
        if self.above is not None:
            return f"> {self.above}"
        return None if self.high is None else f"<= {self.high}"

    def admits(self, value: Any) -> bool:
        """Whether a value is inside the range (NaN is not)."""
        return (
            (self.low is None or value >= self.low)
            and (self.above is None or value > self.above)
            and (self.high is None or value <= self.high)
        )


@dataclasses.dataclass(frozen=True)
class Wording:
    """How check_bounds words a value outside its bound. Placeholders: {name}, {value}, {rule}
    (Bound.rule, then its note), {choices} (the tuple) and {listed} (the choices, comma-joined)."""

    outside: str = "{name} must be {rule}, got {value}"
    not_a_choice: str = "{name} must be one of {listed}, got {value!r}"


def setting(default: Any, **bound: Any) -> Any:
    """A dataclass field with a default and a `Bound` (keywords of Bound)."""
    return dataclasses.field(default=default, metadata={_KEY: Bound(**bound)})


def bound_of(field: dataclasses.Field) -> Bound:
    return field.metadata.get(_KEY, Bound())


def check_bounds(config: Any, wording: Wording = Wording()) -> None:
    """Raises ValueError for the first field outside its declared bound (None, the value of an
    Optional field left unset, is inside every bound)."""
    for field in dataclasses.fields(config):
        bound, value, name = bound_of(field), getattr(config, field.name), field.name
        if value is None:
            continue
        if bound.choices is not None and value not in bound.choices:
            choices = tuple(bound.choices)
            raise ValueError(
                wording.not_a_choice.format(
                    name=name, value=value, choices=choices, listed=", ".join(choices)
                )
            )
        rule = bound.rule()
        if rule is not None and not bound.admits(value):
            rule += f" {bound.note}" if bound.note else ""
            raise ValueError(wording.outside.format(name=name, value=value, rule=rule))


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
    helps: Optional[dict[str, str]] = None,
    pass_on: bool = False,
) -> None:
    """One flag per field of `cls` that has one (`only`: these fields alone, `skip`: but not
    these); `helps` adds to a field's help. `pass_on`: for a command that passes the flags on to
    another process (`planserve serve` to the model service): every flag defaults to None, so
    that only what was given is passed on, and a field with its own `parse` keeps the text as
    given ("2GiB"; `parsed` reads it)."""
    docs = docstrings(cls)
    for field in dataclasses.fields(cls):
        bound = bound_of(field)
        if not bound.cli or field.name in skip or (only is not None and field.name not in only):
            continue
        name = bound.flag or field.name.replace("_", "-")
        default = field.default if bound.cli_default is _UNSET else bound.cli_default
        text = docs.get(field.name, "") + (helps or {}).get(field.name, "")
        if not isinstance(field.default, bool) and default is not dataclasses.MISSING:
            shown = "none" if default is None or default in ("", ()) else default
            text += f" (default: {shown})"  # --help shows every default
        kwargs: dict[str, Any] = {"dest": field.name, "help": text.replace("%", "%%")}
        if isinstance(field.default, bool):
            # A flag turns a setting on or, spelled no-..., off; it also takes the value spelled
            # out ("--enable-lora true"), which is how a flag passed on is written.
            kwargs.update(nargs="?", const=not field.default, type=parse_bool, metavar="BOOL")
            kwargs["default"] = None if pass_on else field.default
        else:
            parse = bound.parse or _value_type(cls, field)
            kwargs["type"] = str if pass_on and bound.parse else parse
            kwargs["default"] = None if pass_on else default
            kwargs["metavar"] = name.upper().replace("-", "_")
            if bound.choices is not None:
                kwargs["choices"] = list(bound.choices)
            if bound.nargs is not None:
                kwargs["nargs"] = bound.nargs
        parser.add_argument("--" + name, *("--" + alias for alias in bound.aliases), **kwargs)


def parse_bool(text: str) -> bool:
    """A boolean flag's spelled-out value: true/false, yes/no, on/off or 1/0."""
    value = str(text).strip().lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def flag_of(cls: type, name: str) -> str:
    """The flag of field `name` of `cls` ("--kv-cache-memory")."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return "--" + (bound_of(field).flag or name.replace("_", "-"))


def parsed(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the text of each field that has its own `parse` read by it (flags kept as
    given by `add_flags(pass_on=True)`)."""
    parses = {f.name: bound_of(f).parse for f in dataclasses.fields(cls)}
    read = dict(values)
    for name, value in values.items():
        parse = parses.get(name)
        if parse is not None and isinstance(value, str):
            read[name] = parse(value)
    return read


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The config the parsed flags describe (fields without a flag keep their defaults)."""
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
    }
    # A flag with nargs gives a list; the frozen config holds a tuple.
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    return cls(**{**given, **overrides})
