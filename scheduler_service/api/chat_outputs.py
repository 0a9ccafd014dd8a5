"""One chat sample's text split into reasoning, content and tool calls, whole or as it streams.

With a reasoning parser the think block is split off first (text/reasoning.py) and the rest
goes on as the content below; tool calls are read from that content only.

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
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.text.reasoning import ReasoningSplit
from scheduler_service.text.tool_parsers import Parsed, ToolCall, ToolParser
from scheduler_service.text.tool_parsers.base import call_from, new_call_id

_ENDED_BY_ITSELF = (FinishReason.EOS, FinishReason.STOP)


class ChatOutput:
    """One sample's split; `feed` its text as it comes, `finish` once it ended (the tool
    split); `message` and `deltas` put the reasoning split in front of it."""

    def __init__(
        self,
        plan: ToolPlan,
        parser: Optional[ToolParser],
        reasoning: Optional[ReasoningSplit] = None,
    ):
        self.plan, self.parser, self.reasoning = plan, parser, reasoning
        self.reasoning_text = ""  # the reasoning given out so far
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

    def _think(self, text: str, ended: bool) -> tuple[str, str]:
        """(reasoning, content) of generated text: all content without a reasoning parser."""
        if self.reasoning is None:
            return "", text
        reasoning, content = self.reasoning.feed(text)
        if ended:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        self.reasoning_text += reasoning
        return reasoning, content

    def message(self, text: str, reason: Optional[FinishReason]) -> dict[str, Any]:
        """A whole sample as a chat message (content null when it only called tools)."""
        _, text = self._think(text, ended=True)
        content: Optional[str] = self.feed(text) + self.finish(reason)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning_text or None
        if self.calls:
            message["content"] = content if content and content.strip() else None
            message["tool_calls"] = self.tool_calls()
        return message

    def step(self, text: str, reason: Optional[FinishReason]) -> tuple[str, str, list[dict]]:
        """One streamed output of the sample: (reasoning, content) that may go now, and once the
        sample ended the held content too and its calls (as `tool_calls`)."""
        reasoning, text = self._think(text, ended=reason is not None)
        content = self.feed(text)
        if reason is None:
            return reasoning, content, []
        content += self.finish(reason)
        return reasoning, content, self.tool_calls()

    def deltas(self, text: str, reason: Optional[FinishReason]) -> list[dict[str, Any]]:
        """The chunk deltas one streamed output becomes (`step`): its reasoning and content, then
        each call (id and name, then arguments)."""
        reasoning, content, calls = self.step(text, reason)
        deltas: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        deltas += [{"content": content}] if content else []
        for index, call in enumerate(calls):
            function = call["function"]
            head = dict(call, function={"name": function["name"], "arguments": ""})
            deltas.append({"tool_calls": [dict(head, index=index)]})
            arguments = {"arguments": function["arguments"]}
            deltas.append({"tool_calls": [{"index": index, "function": arguments}]})
        return deltas


def for_samples(
    req: Request, plan: Optional[ToolPlan], parser: Optional[ToolParser], reasoning_parser: str
) -> Optional[list[ChatOutput]]:
    """Each sample's split of a chat request; None when there is nothing to split. A request
    with a grammar is split too: its grammar applies after the think block (admission)."""
    reasoning = reasoning_parser
    if plan is None and not reasoning:
        return None
    plan = plan or ToolPlan("none", ())
    return [
        ChatOutput(plan, parser, ReasoningSplit(reasoning) if reasoning else None)
        for _ in range(req.n)
    ]
