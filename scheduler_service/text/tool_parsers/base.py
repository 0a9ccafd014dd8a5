"""What a tool-call parser is: the model's text in, the content and the calls it made out.

A parser reads one family's call format ("auto" tool choice). It answers two questions:
`parse(text)` on a whole output (the content around the calls, the calls), and `hold_from(text)`
on an output still being generated: where the text that may turn out to be a call starts.
A streamed response sends the text before that point as content at once and holds the rest
until the sample ends, then parses the whole output. Both paths end in `parse`, so a response
gets the same calls streamed or not.

A call the parser cannot read (malformed JSON, a missing name) is not a call: its text stays in
the content, so nothing invalid ever reaches `tool_calls`.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import uuid
from typing import Any, ClassVar

from scheduler_service.registry import Registry


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A whole output split: the text that is not a call, and the calls in order."""

    content: str
    calls: tuple[ToolCall, ...] = ()


class ToolParser(abc.ABC):
    """One model family's tool-call format. Stateless: one instance serves every request."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def parse(self, text: str) -> Parsed:
        """The content and the calls of a whole output."""

    @abc.abstractmethod
    def hold_from(self, text: str) -> int:
        """Where the text that may belong to a call starts in an output so far (len(text) when
        none may): text before it is content whatever comes next."""

    def new_call_id(self) -> str:
        """The id a call gets in the response (a family may need its own spelling)."""
        return new_call_id()


def new_call_id() -> str:
    """OpenAI's spelling of a call id."""
    return "call_" + uuid.uuid4().hex[:24]


TOOL_PARSERS: Registry[type[ToolParser]] = Registry(
    "tool parser", ToolParser, "planserve.tool_parsers"
)


def register(cls: type[ToolParser]) -> type[ToolParser]:
    return TOOL_PARSERS.register(cls)


def marker_hold(text: str, marker: str) -> int:
    """Where `marker` starts in `text`, or where a tail of `text` that could still grow into it
    starts (len(text) when neither)."""
    found = text.find(marker)
    if found >= 0:
        return found
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


def leading_hold(text: str, openers: tuple[str, ...]) -> int:
    """For formats where the whole output is the calls: 0 (hold everything) while the output,
    past leading whitespace, is empty or starts with (or could grow into) one of `openers`;
    len(text) (all content) once it cannot."""
    stripped = text.lstrip()
    if not stripped:
        return 0
    for opener in openers:
        if stripped.startswith(opener) or opener.startswith(stripped):
            return 0
    return len(text)


def call_from(obj: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A decoded {"name": ..., "arguments": {...}} as a ToolCall; ValueError when it is not one.
    Arguments given as a JSON string are taken when they decode to an object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("not a call: needs a string name")
    arguments: Any = {}
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("not a call: arguments must be an object")
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
