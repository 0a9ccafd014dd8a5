"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3, and planserve's default tool format):

    some text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each call is one JSON object between the tags; a last call whose closing tag never came (the
model ended on it) is read too. A block whose JSON does not decode stays in the content.
"""

from __future__ import annotations

import json
import re

from scheduler_service.text.tool_parsers.base import (
    Parsed,
    ToolCall,
    ToolParser,
    call_from,
    marker_hold,
    register,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@register
class HermesParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Qwen2.5/3, Hermes)."""

    name = "hermes"

    def hold_from(self, text: str) -> int:
        return marker_hold(text, OPEN)

    def parse(self, text: str) -> Parsed:
        calls: list[ToolCall] = []
        content: list[str] = []
        end = 0
        for block in _BLOCK.finditer(text):
            between = text[end : block.start()]
            try:
                call = call_from(json.loads(block.group(1)))
            except ValueError:  # JSONDecodeError too: not a call, its text stays
                content.append(between + block.group(0))
            else:
                # Whitespace between and after calls is layout, not content.
                content.append(between if not calls or between.strip() else "")
                calls.append(call)
            end = block.end()
        tail = text[end:]
        content.append(tail if not calls or tail.strip() else "")
        return Parsed("".join(content), tuple(calls))
