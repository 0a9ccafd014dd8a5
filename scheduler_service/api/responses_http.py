"""POST /v1/responses: OpenAI's Responses API, a thin door over the chat completions' path.

The body is read as the chat request it is (responses_items.py), admitted by the same admission
(OpenAIApp.admit), read through the same output path (streams.outputs_of) and split by the same
ChatOutput; only the shapes differ. Streamed as the Responses events: response.created, then per
output item response.output_item.added, its deltas (response.output_text.delta,
response.reasoning_text.delta, response.function_call_arguments.delta), their .done events and
response.output_item.done, and last response.completed (status "incomplete" with reason
max_output_tokens when cut). One sample per request.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request as HttpRequest

from scheduler_service.api import chat_outputs
from scheduler_service.api import responses_items as items
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
from scheduler_service.core.request import FinishReason, Request


class ResponsesDoor:
    """Adds POST /v1/responses to an OpenAIApp."""

    def __init__(self, door: OpenAIApp):
        self.door = door
        post_json(door.app, "/v1/responses", self.responses)

    async def responses(self, body: items.ResponsesRequest, http: HttpRequest):
        chat = items.to_chat(body)
        serving, req, plan = await self.door.admit(chat, chat=True, http=http)
        door = self.door
        splits = chat_outputs.for_samples(req, plan, door.tool_parser, door.reasoning_parser)
        split = splits[0] if splits else ChatOutput(ToolPlan("none", ()), None)
        answer = _Answer(serving, req, split, body)
        if body.stream:
            return EventStream(answer.events())
        return await unless_disconnected(http, answer.collect())


class _Answer:
    def __init__(
        self, serving: Serving, req: Request, split: ChatOutput, body: items.ResponsesRequest
    ):
        self.serving, self.req, self.split, self.body = serving, req, split, body
        self.id = "resp_" + req.request_id
        self.created_at = int(time.time())
        self.output_tokens = 0
        self.sequence_number = 0

    def _response(self, output: list[dict], reason: Optional[FinishReason]) -> dict[str, Any]:
        cut = reason is not None and reason is FinishReason.LENGTH
        status = "in_progress" if reason is None else ("incomplete" if cut else "completed")
        input_tokens = len(self.req.prompt_token_ids)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None,
            "model": self.serving.facts.model_name,
            "instructions": self.body.instructions,
            "output": output,
            "parallel_tool_calls": self.body.parallel_tool_calls is not False,
            "tool_choice": self.body.tool_choice or ("auto" if self.body.tools else "none"),
            "tools": self.body.tools or [],
            "temperature": self.body.temperature,
            "top_p": self.body.top_p,
            "max_output_tokens": self.body.max_output_tokens,
            "store": False,
            "text": {"format": {"type": "text"}},
            "usage": {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + self.output_tokens,
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
        return self._response(items.output_items(message), sample.finish_reason)

    def event(self, kind: str, payload: dict[str, Any]) -> str:
        self.sequence_number += 1
        body = dict(payload, type=kind, sequence_number=self.sequence_number)
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    async def events(self) -> AsyncIterator[str]:
        yield self.event("response.created", {"response": self._response([], None)})
        tracker = _Items(self)
        async with contextlib.aclosing(outputs_of(self.serving.frontend, self.req)) as stream:
            async for output in stream:
                if output.usage is not None:
                    self.output_tokens = output.usage.completion_tokens
                deltas = self.split.deltas(output.text, output.finish_reason)
                events = [event for delta in deltas for event in tracker.add(delta)]
                if output.finish_reason is None:
                    for event in events:
                        yield event
                    continue
                events += tracker.close()
                response = self._response(tracker.done, output.finish_reason)
                completed = self.event("response.completed", {"response": response})
                yield LastEvents("".join(events) + completed)  # with the body's end


class _Items:
    """Chat deltas (ChatOutput.deltas) to output item events: an item opens when the kind of
    delta changes (reasoning, text, each function call) and is done before the next opens."""

    def __init__(self, answer: _Answer):
        self.answer = answer
        self.done: list[dict[str, Any]] = []  # finished items, as response.completed lists them
        self.kind: Optional[str] = None
        self.item: dict[str, Any] = {}
        self.text = ""  # the open item's text or arguments so far

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.done)}

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        event, where, text = self.answer.event, self._where(), self.text
        if self.kind == "text":
            self.item = items.message_item(text, self.item["id"])
            part = self.item["content"][0]
            closing = [
                event("response.output_text.done", dict(where, content_index=0, text=text)),
                event("response.content_part.done", dict(where, content_index=0, part=part)),
            ]
        elif self.kind == "reasoning":
            self.item = items.reasoning_item(text, self.item["id"])
            closing = [
                event("response.reasoning_text.done", dict(where, content_index=0, text=text))
            ]
        else:
            self.item = dict(self.item, arguments=text, status="completed")
            closing = [event("response.function_call_arguments.done", dict(where, arguments=text))]
        closing.append(
            event("response.output_item.done", {"output_index": len(self.done), "item": self.item})
        )
        self.done.append(self.item)
        self.kind, self.text = None, ""
        return closing

    def _open(self, kind: str, item: dict[str, Any]) -> list[str]:
        opening = self.close()
        self.kind, self.item = kind, item
        opening.append(
            self.answer.event(
                "response.output_item.added", {"output_index": len(self.done), "item": item}
            )
        )
        if kind == "text":
            part = {"type": "output_text", "text": "", "annotations": []}
            opening.append(
                self.answer.event(
                    "response.content_part.added", dict(self._where(), content_index=0, part=part)
                )
            )
        return opening

    def _delta(self, kind: str, text: str) -> str:
        self.text += text
        where = (
            self._where()
            if kind == "response.function_call_arguments.delta"
            else dict(self._where(), content_index=0)
        )
        return self.answer.event(kind, dict(where, delta=text))

    def add(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning_content"):
            if self.kind != "reasoning":
                events += self._open("reasoning", dict(items.reasoning_item(""), content=[]))
            events.append(self._delta("response.reasoning_text.delta", delta["reasoning_content"]))
        if delta.get("content"):
            if self.kind != "text":
                events += self._open(
                    "text", items.message_item("", status="in_progress") | {"content": []}
                )
            events.append(self._delta("response.output_text.delta", delta["content"]))
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                events += self._open("function_call", items.call_item(call, status="in_progress"))
            arguments = call["function"].get("arguments")
            if arguments:
                events.append(self._delta("response.function_call_arguments.delta", arguments))
        return events
