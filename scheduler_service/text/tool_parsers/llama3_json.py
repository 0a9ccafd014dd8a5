"""Llama 3.1/3.2 JSON calls: the whole output is one or more JSON objects, optionally after
`<|python_tag|>`, separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ..., "parameters": ...}

An output that starts otherwise, or whose objects do not all decode as calls, is content.
"""

from __future__ import annotations

import json

from scheduler_service.text.tool_parsers.base import (
    Parsed,
    ToolCall,
    ToolParser,
    call_from,
    leading_hold,
    register,
)

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _objects(text: str) -> list[object]:
    """The `;`-separated JSON values of `text`; ValueError when anything else is there."""
    values: list[object] = []
    at = 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return values
        value, at = _DECODER.raw_decode(text, at)
        values.append(value)


@register
class Llama3JsonParser(ToolParser):
    """{"name": ..., "parameters": {...}} objects, `;`-separated (Llama 3.1/3.2)."""

    name = "llama3_json"

    def hold_from(self, text: str) -> int:
        return leading_hold(text, ("{", PYTHON_TAG))

    def parse(self, text: str) -> Parsed:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        if not body.lstrip().startswith("{"):
            return Parsed(text)
        try:
            calls: list[ToolCall] = [
                call_from(value, ("parameters", "arguments")) for value in _objects(body)
            ]
        except ValueError:
            return Parsed(text)
        return Parsed("", tuple(calls))
