"""Pythonic calls (Llama 3.2 and 4, ToolACE): the whole output is a Python list of calls with
keyword arguments, optionally between `<|python_start|>` and `<|python_end|>`:

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

Arguments must be literals (strings, numbers, lists, dicts, True/False/None; JSON's
true/false/null are read as well). Anything else is content.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from scheduler_service.text.tool_parsers.base import (
    Parsed,
    ToolCall,
    ToolParser,
    leading_hold,
    register,
)

START, END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ValueError("** in a dict is not a literal")
        return {_literal(key): _literal(value) for key, value in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments")
    name = ast.unparse(node.func)  # a dotted name is kept whole
    if not isinstance(node.func, (ast.Name, ast.Attribute)):
        raise ValueError("not a function name")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs is not a literal argument")
        arguments[keyword.arg] = _literal(keyword.value)
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


@register
class PythonicParser(ToolParser):
    """[f(a=1), g(b="x")]: a Python list of calls (Llama 3.2/4 pythonic, ToolACE)."""

    name = "pythonic"

    def hold_from(self, text: str) -> int:
        return leading_hold(text, ("[", START))

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START) :].removesuffix(END).strip()
        if not body.startswith("["):
            return Parsed(text)
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return Parsed(text)
            calls = tuple(_call(node) for node in tree.elts)
        except (SyntaxError, ValueError, TypeError):
            return Parsed(text)
        return Parsed("", calls)
