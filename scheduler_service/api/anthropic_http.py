"""POST /v1/messages: Anthropic's Messages API, a thin door over the chat completions' path.

The body is read as the chat request it is (anthropic_messages.py), admitted by the same
admission (OpenAIApp.admit: the same bounds, tools, grammars), read through the same output path
(streams.outputs_of) and split by the same ChatOutput; only the shapes differ. Streamed as
Anthropic's events: message_start, then per block content_block_start / content_block_delta
(text_delta, thinking_delta, input_json_delta) / content_block_stop, then message_delta (the
stop_reason and output tokens) and message_stop. One sample per request (Anthropic has no n).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Optional

from fastapi import Request as HttpRequest

from scheduler_service.api import anthropic_messages as shapes
from scheduler_service.api import chat_outputs
from scheduler_service.api.admission import Serving
from scheduler_service.api.chat_outputs import ChatOutput
from scheduler_service.api.json_route import post_json
from scheduler_service.api.openai_http import OpenAIApp
from scheduler_service.api.streams import (
    Collected,
    EventStream,
    LastEvents,
    outputs_of,
    unless_disconnected,
)
from scheduler_service.api.tool_requests import ToolPlan
from scheduler_service.core.request import Request

_DELTA_KINDS = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}
_DELTA_FIELDS = {"text": "text", "thinking": "thinking", "tool_use": "partial_json"}


def _event(kind: str, payload: dict[str, Any]) -> str:
    data = json.dumps(dict(payload, type=kind), separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n"


class MessagesDoor:
    """Adds POST /v1/messages to an OpenAIApp."""

    def __init__(self, door: OpenAIApp):
        self.door = door
        post_json(door.app, "/v1/messages", self.messages)

    async def messages(self, body: shapes.MessagesRequest, http: HttpRequest):
        chat = shapes.to_chat(body)
        serving, req, plan = await self.door.admit(chat, chat=True, http=http)
        split = self._split(req, plan)
        answer = _Answer(serving, req, split)
        if body.stream:
            return EventStream(answer.events())
        return await unless_disconnected(http, answer.collect())

    def _split(self, req: Request, plan: Optional[ToolPlan]) -> ChatOutput:
        door = self.door
        splits = chat_outputs.for_samples(req, plan, door.tool_parser, door.reasoning_parser)
        return splits[0] if splits else ChatOutput(ToolPlan("none", ()), None)


class _Answer:
    """One admitted request's Anthropic answer, whole or as events."""

    def __init__(self, serving: Serving, req: Request, split: ChatOutput):
        self.serving, self.req, self.split = serving, req, split
        self.id = "msg_" + req.request_id
        self.output_tokens = 0

    def _message(self, content: list[dict[str, Any]], stop_reason: Optional[str]) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.serving.facts.model_name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(self.req.prompt_token_ids),
                "output_tokens": self.output_tokens,
            },
        }

    async def collect(self) -> dict:
        collected = Collected(1)
        async with contextlib.aclosing(outputs_of(self.serving.frontend, self.req)) as stream:
            async for output in stream:
                collected.add(output)
                if output.usage is not None:
                    self.output_tokens = output.usage.completion_tokens
        sample = collected.samples[0]
        message = self.split.message(sample.text, sample.finish_reason)
        stop = shapes.stop_reason(sample.finish_reason, bool(self.split.calls))
        return self._message(shapes.content_blocks(message), stop)

    async def events(self) -> AsyncIterator[str]:
        yield _event("message_start", {"message": self._message([], None)})
        blocks = _Blocks()
        last: list[str] = []  # the final output's events, sent with message_stop
        async with contextlib.aclosing(outputs_of(self.serving.frontend, self.req)) as stream:
            async for output in stream:
                if output.usage is not None:
                    self.output_tokens = output.usage.completion_tokens
                deltas = self.split.deltas(output.text, output.finish_reason)
                events = [event for delta in deltas for event in blocks.add(delta)]
                if output.finish_reason is None:
                    for event in events:
                        yield event
                    continue
                stop = shapes.stop_reason(output.finish_reason, bool(self.split.calls))
                usage = {"output_tokens": self.output_tokens}
                delta = {"stop_reason": stop, "stop_sequence": None}
                last = [
                    *events,
                    *blocks.close(),
                    _event("message_delta", {"delta": delta, "usage": usage}),
                ]
        yield LastEvents("".join(last) + _event("message_stop", {}))


class _Blocks:
    """Chat deltas (ChatOutput.deltas) to Anthropic's content block events: a block opens when
    the kind of delta changes (thinking, text, each tool_use) and closes before the next."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: Optional[str] = None

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [
            _event("content_block_start", {"index": self.index, "content_block": block})
        ]

    def _delta(self, text: str) -> str:
        assert self.kind is not None
        delta = {"type": _DELTA_KINDS[self.kind], _DELTA_FIELDS[self.kind]: text}
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def add(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                events += self._open(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            events.append(self._delta(delta["reasoning_content"]))
        if delta.get("content"):
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta(delta["content"]))
        for call in delta.get("tool_calls") or ():
            function = call["function"]
            if "id" in call:  # a call's head: its own block
                block = {
                    "type": "tool_use",
                    "id": shapes.tool_use_id(),
                    "name": function["name"],
                    "input": {},
                }
                events += self._open("tool_use", block)
            if function.get("arguments"):
                events.append(self._delta(function["arguments"]))
        return events
