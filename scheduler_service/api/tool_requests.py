"""Tools in a chat request: `tools`, `tool_choice`, `parallel_tool_calls` checked and planned,
for every door (the HTTP API's bodies, gRPC's GenerateRequest): each door hands them over in
OpenAI's shape and words a `ToolError` its own way.

A request's tools become a `ToolPlan`: which choice the request made, the functions it offers,
and, for "required" or a named function, the JSON schema its output is generated under
(structured output's grammar engine, text/structured.py), so that such a call is always valid:

    tool_choice        the model writes                      grammar
    "none"             text (never parsed for calls)         none
    "auto"             text, parsed by --tool-call-parser    none
    "required"         [{"name": ..., "arguments": {...}}]   anyOf the tools, at least one call
    {"function": f}    f's arguments object                  f's parameters schema

Bounds (each refusal a `ToolError` naming the parameter: a 400 or INVALID_ARGUMENT): at most
MAX_TOOLS tools, their JSON at most MAX_TOOLS_CHARS characters in all (every schema may end up
in one grammar), names as OpenAI allows them and distinct.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

MAX_TOOLS = 128  # OpenAI's own bound
MAX_TOOLS_CHARS = 32768  # the tools' JSON in all; structured.MAX_GRAMMAR_CHARS leaves room
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule, with dots for dotted names
CHOICES = ("none", "auto", "required")
# A function without parameters takes an empty object.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(ValueError):
    """A refused tool field: `param` the request parameter it belongs to (tools, tool_choice,
    messages or the other grammar's), `path` where in it (OpenAI's spelling,
    "tools[2].function.name"), `detail` what is wrong."""

    def __init__(self, param: str, path: str, detail: str):
        super().__init__(f"{path}: {detail}")
        self.param, self.path, self.detail = param, path, detail


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a request asked of its tools. `choice`: none, auto, required, or function (with
    `named`); `functions`: each tool's {"name", "description", "parameters"}."""

    choice: str
    functions: tuple[dict[str, Any], ...]
    named: Optional[str] = None
    parallel: bool = True

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools as a chat template takes them (transformers' `tools=`)."""
        return [{"type": "function", "function": function} for function in self.functions]

    @property
    def guided(self) -> bool:
        """Whether the output is generated under a grammar (required or a named function)."""
        return self.choice in ("required", "function")

    def parameters(self, name: str) -> dict[str, Any]:
        for function in self.functions:
            if function["name"] == name:
                return function.get("parameters") or _NO_PARAMETERS
        raise KeyError(name)

    def grammar_schema(self) -> Optional[dict[str, Any]]:
        """The JSON schema the output is generated under; None for none and auto."""
        if self.choice == "function":
            assert self.named is not None
            return self.parameters(self.named)
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": self.parameters(function["name"]),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for function in self.functions
        ]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": items, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def _function(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolError("tools", f"{where}.type", 'must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError("tools", f"{where}.function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(
            "tools",
            f"{where}.function.name",
            f"must be 1 to 64 letters, digits, _, . or -, got {name!r}",
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolError("tools", f"{where}.function.parameters", "must be a JSON schema object")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError("tools", f"{where}.function.description", "must be a string")
    kept = {"name": name, "description": description, "parameters": parameters}
    return {key: value for key, value in kept.items() if value is not None}


def _functions(tools: list[Any]) -> tuple[dict[str, Any], ...]:
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", "tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    size = len(json.dumps(tools, ensure_ascii=False))
    if size > MAX_TOOLS_CHARS:
        raise ToolError(
            "tools", "tools", f"at most {MAX_TOOLS_CHARS} characters of JSON in all, got {size}"
        )
    functions = tuple(_function(index, tool) for index, tool in enumerate(tools))
    seen: set[str] = set()
    for index, function in enumerate(functions):
        if function["name"] in seen:
            raise ToolError(
                "tools", f"tools[{index}].function.name", f"{function['name']!r} is named twice"
            )
        seen.add(function["name"])
    return functions


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, Optional[str]]:
    """(choice, the named function) of a request's tool_choice."""
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(
                "tool_choice",
                "tool_choice",
                f"must be none, auto, required or a function, got {tool_choice!r}",
            )
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise ToolError(
            "tool_choice",
            "tool_choice",
            'must be none, auto, required or {"type": "function", "function": {"name": ...}}',
        )
    if name not in names:
        offered = ", ".join(names) or "none"
        raise ToolError(
            "tool_choice",
            "tool_choice.function.name",
            f"no tool named {name!r} (tools: {offered})",
        )
    return "function", name


def plan_tools(
    tools: Optional[list[Any]],
    tool_choice: Any,
    parallel_tool_calls: Optional[bool],
    grammar_param: Optional[str],
    auto_parser: Optional[str],
) -> Optional[ToolPlan]:
    """A request's ToolPlan (None without tools), from its fields in OpenAI's shape.
    `grammar_param`: the parameter of the request's own grammar, if any (response_format,
    structured_output...); `auto_parser`: the server's tool-call parser when
    --enable-auto-tool-choice is on, else None ("auto" is refused then)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice", "tool_choice", "needs tools")
        return None
    functions = _functions(tools)
    # OpenAI's default with tools is "auto": without a parser that is refused, never quietly
    # turned into "none".
    choice, named = _choice(
        "auto" if tool_choice is None else tool_choice,
        [function["name"] for function in functions],
    )
    if choice == "auto" and auto_parser is None:
        raise ToolError(
            "tool_choice",
            "tool_choice",
            '"auto" needs the server started with --enable-auto-tool-choice '
            "--tool-call-parser NAME (none, required and a named function need neither)",
        )
    plan = ToolPlan(choice, functions, named, parallel_tool_calls is not False)
    if plan.guided and grammar_param is not None:
        raise ToolError(
            grammar_param,
            grammar_param,
            f"cannot be combined with tool_choice {choice!r} (its calls have a grammar)",
        )
    return plan
