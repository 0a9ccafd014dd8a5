"""Mistral calls: content, then `[TOOL_CALLS]` and a JSON list of calls:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

`[TOOL_CALLS]` is a control token in Mistral's vocabularies; planserve parses the decoded text,
so it must survive detokenization (docs/tools.md). Call ids are 9 letters and digits, the only
ids Mistral's chat templates accept back in the history. A list that does not decode is content.
"""

from __future__ import annotations

import json
import secrets
import string

from scheduler_service.text.tool_parsers.base import (
    Parsed,
    ToolParser,
    call_from,
    marker_hold,
    register,
)

MARKER = "[TOOL_CALLS]"
_ID_ALPHABET = string.ascii_letters + string.digits


@register
class MistralParser(ToolParser):
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (Mistral, Mixtral)."""

    name = "mistral"

    def hold_from(self, text: str) -> int:
        return marker_hold(text, MARKER)

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def parse(self, text: str) -> Parsed:
        at = text.find(MARKER)
        if at < 0:
            return Parsed(text)
        try:
            value = json.loads(text[at + len(MARKER) :])
            values = value if isinstance(value, list) else [value]
            calls = tuple(call_from(item) for item in values)
        except ValueError:
            return Parsed(text)
        return Parsed(text[:at], calls) if calls else Parsed(text)
