"""A chat request with tools, or with tool calls and results in its history, to its prompt.

Such a conversation does not fit the public request's `messages` (role and text only), so the
HTTP door renders it here and sends the prompt's token ids, which admission checks as any
other prompt. The chat template renders the tools when it reads `tools` (transformers'
convention: tools as OpenAI's tool objects, an assistant turn's `tool_calls` with their
arguments as objects, `tool` turns with `tool_call_id`); otherwise the conversation is first
rewritten in planserve's default tool format (text/tool_prompt.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

import jinja2

from planserve.v1 import generate_pb2
from scheduler_service.api.openai_errors import ApiError
from scheduler_service.api.openai_requests import (
    ChatCompletionRequest,
    ChatMessage,
    to_pb,
)
from scheduler_service.api.tool_requests import ToolPlan, plan_tools
from scheduler_service.text import tool_prompt
from scheduler_service.text.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


def has_tool_turns(messages: list[ChatMessage]) -> bool:
    return any(message.role == "tool" or message.tool_calls for message in messages)


def _text(index: int, message: ChatMessage) -> str:
    content = message.content
    if not isinstance(content, list):
        return content or ""
    for part in content:
        if part.type != "text":
            raise ApiError(
                400,
                f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                param="messages",
            )
    return "".join(part.text or "" for part in content)


def _call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"{where}.function.name: must be a string", param="messages")
    arguments = function.get("arguments", "{}")
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as error:
        raise ApiError(
            400, f"{where}.function.arguments: not valid JSON ({error})", param="messages"
        ) from None
    if not isinstance(decoded, dict):
        raise ApiError(400, f"{where}.function.arguments: must be a JSON object", param="messages")
    # Templates write the arguments with `tojson`: an object, not its JSON text.
    function = {"name": function["name"], "arguments": decoded}
    return {"id": call.get("id") or "", "type": "function", "function": function}


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat template dicts (OpenAI's shape; `developer` read as `system`)."""
    turns = []
    for index, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        if role not in ROLES:
            raise ApiError(
                400,
                f"messages[{index}].role: must be system, user, assistant or tool, got {role!r}",
                param="messages",
            )
        turn: dict[str, Any] = {"role": role, "content": _text(index, message)}
        if message.tool_calls:
            if role != "assistant":
                raise ApiError(
                    400, f"messages[{index}].tool_calls: only on assistant turns", param="messages"
                )
            where = f"messages[{index}].tool_calls"
            turn["tool_calls"] = [
                _call(f"{where}[{number}]", call) for number, call in enumerate(message.tool_calls)
            ]
        if role == "tool":
            turn["tool_call_id"] = message.tool_call_id or ""
            name = (message.model_extra or {}).get("name")  # the function's name, if sent
            if isinstance(name, str):
                turn["name"] = name
        turns.append(turn)
    return turns


def render(messages: list[ChatMessage], plan: Optional[ToolPlan], tokenizer: Tokenizer) -> str:
    """The prompt's text: the conversation and the plan's tools, rendered."""
    turns = conversation(messages)
    tools = plan.tools if plan is not None else None
    if not tokenizer.has_chat_template:
        raise ApiError(400, "messages: the served model has no chat template", param="messages")
    try:
        if tokenizer.supports_tools:
            return tokenizer.render_chat(turns, tools)
        return tokenizer.render_chat(tool_prompt.default_format(turns, tools))
    except jinja2.TemplateError as error:
        raise ApiError(
            400, f"messages: the chat template refused them ({error})", param="messages"
        ) from None


def prompt_ids(
    messages: list[ChatMessage], plan: Optional[ToolPlan], tokenizer: Tokenizer
) -> list[int]:
    """The prompt's token ids (the template wrote every special token it wants)."""
    return tokenizer.encode(render(messages, plan, tokenizer), add_special_tokens=False)


def chat_request_pb(
    body: ChatCompletionRequest, auto_parser: Optional[str], tokenizer: Tokenizer
) -> tuple[generate_pb2.GenerateRequest, Optional[ToolPlan]]:
    """A chat body's public request and its tool plan (None without tools): with tools or tool
    turns its prompt is rendered here; "required" or a named function adds its calls' grammar."""
    plan = plan_tools(body, auto_parser)
    ids = None
    if plan is not None or has_tool_turns(body.messages):
        ids = prompt_ids(body.messages, plan, tokenizer)
    pb = to_pb(body, uuid.uuid4().hex, ids)
    schema = plan.grammar_schema() if plan is not None else None
    if schema is not None:
        pb.structured_output.json_schema = json.dumps(schema, ensure_ascii=False)
    return pb, plan
