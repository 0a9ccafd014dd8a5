"""One sample's text split into content and tool calls, whole or as it streams.

The text before anything that may be a call is content at once (streamed as it comes); the rest
is held until the sample ends and is then read whole: by the tool-call parser ("auto"), or as
the JSON its grammar generated ("required", a named function). A sample that did not end by
itself (cut by max_tokens, aborted) is never read for calls: its held text is content and its
finish reason stays, so a cut call never becomes an invalid `tool_calls` entry. A whole
response feeds the same object all its text at once, so it gets what the stream would.

Calls are sent when complete: a streamed call is one delta with its id, type and name (and
empty arguments), then one delta with its arguments.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from scheduler_service.api.streams import finish_reason_name
from scheduler_service.api.tool_requests import ToolPlan
from scheduler_service.core.request import FinishReason
from scheduler_service.text.tool_parsers import Parsed, ToolCall, ToolParser
from scheduler_service.text.tool_parsers.base import call_from, new_call_id

_ENDED_BY_ITSELF = (FinishReason.EOS, FinishReason.STOP)


class ToolOutput:
    """One sample's split; `feed` its text as it comes, `finish` once it ended."""

    def __init__(self, plan: ToolPlan, parser: Optional[ToolParser]):
        self.plan, self.parser = plan, parser
        self.text = ""  # the sample's whole text so far
        self.num_sent = 0  # characters of `text` already given out as content
        self.calls: tuple[ToolCall, ...] = ()

    def _hold_from(self) -> int:
        if self.plan.choice == "none":
            return len(self.text)
        if self.plan.choice == "auto" and self.parser is not None:
            return max(self.num_sent, self.parser.hold_from(self.text))
        return self.num_sent  # a grammar's output is read whole

    def feed(self, text: str) -> str:
        """Adds generated text; returns the content that may be sent now."""
        self.text += text
        hold = self._hold_from()
        content, self.num_sent = self.text[self.num_sent : hold], hold
        return content

    def _parse(self, reason: Optional[FinishReason]) -> Parsed:
        text, choice = self.text, self.plan.choice
        if choice == "none" or reason not in _ENDED_BY_ITSELF:
            return Parsed(text)
        if choice == "auto":
            return self.parser.parse(text) if self.parser is not None else Parsed(text)
        try:
            decoded = json.loads(text)
            if choice == "function":
                assert self.plan.named is not None
                return Parsed("", (call_from({"name": self.plan.named, "arguments": decoded}),))
            if not isinstance(decoded, list) or not decoded:
                return Parsed(text)
            return Parsed("", tuple(call_from(item) for item in decoded))
        except ValueError:  # the grammar was not applied to the end: text, not calls
            return Parsed(text)

    def finish(self, reason: Optional[FinishReason]) -> str:
        """The sample ended: reads the held text; returns the content not sent yet (the calls
        are in `calls`)."""
        parsed = self._parse(reason)
        sent = self.text[: self.num_sent]
        if not parsed.content.startswith(sent):  # a parser that broke its own hold rule
            parsed = Parsed(self.text)
        self.calls = parsed.calls
        return parsed.content[len(sent) :]

    def finish_reason(self, reason: Optional[FinishReason]) -> Optional[str]:
        return "tool_calls" if self.calls else finish_reason_name(reason)

    def _call_id(self) -> str:
        return self.parser.new_call_id() if self.parser is not None else new_call_id()

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls as a message's `tool_calls`."""
        return [
            {
                "id": self._call_id(),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in self.calls
        ]

    def message(self, text: str, reason: Optional[FinishReason]) -> dict[str, Any]:
        """A whole sample as a chat message (content null when it only called tools)."""
        content = self.feed(text) + self.finish(reason)
        if not self.calls:
            return {"role": "assistant", "content": content}
        return {
            "role": "assistant",
            "content": content if content.strip() else None,
            "tool_calls": self.tool_calls(),
        }

    def deltas(self, text: str, reason: Optional[FinishReason]) -> list[dict[str, Any]]:
        """The chunk deltas one streamed output becomes: its content that may go now, and
        once the sample ended the held content and each call (id and name, then arguments)."""
        content = self.feed(text)
        if reason is not None:
            content += self.finish(reason)
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        for index, call in enumerate(self.tool_calls() if reason is not None else ()):
            function = call["function"]
            head = dict(call, function={"name": function["name"], "arguments": ""})
            deltas.append({"tool_calls": [dict(head, index=index)]})
            arguments = {"arguments": function["arguments"]}
            deltas.append({"tool_calls": [{"index": index, "function": arguments}]})
        return deltas
