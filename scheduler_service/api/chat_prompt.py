"""A chat body with tools, or with tool calls and results in its history, to its public request.

Such a conversation does not fit the public request's plain `messages`, so the HTTP door renders
it (api/tool_turns.py, shared with the gRPC door) and sends the prompt's token ids, which
admission checks as any other prompt. The tools are checked and planned by the doors' one
owner, api/tool_requests.py; its refusals become OpenAI's 400 naming the parameter here.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from planserve.v1 import generate_pb2
from scheduler_service.api import tool_requests, tool_turns
from scheduler_service.api.openai_errors import ApiError
from scheduler_service.api.openai_requests import (
    ChatCompletionRequest,
    ChatMessage,
    structured_param,
    to_pb,
)
from scheduler_service.api.tool_requests import ToolError, ToolPlan
from scheduler_service.text.tokenizer import ChatTemplateOptions, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
# What the renderer itself passes the template: a request's chat_template_kwargs may not replace it.
_RESERVED_TEMPLATE_NAMES = frozenset(
    ("messages", "tools", "add_generation_prompt", "continue_final_message")
    + ("bos_token", "eos_token", "pad_token", "unk_token")
)


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
    if not isinstance(function, dict):
        raise ToolError("messages", f"{where}.function.name", "must be a string")
    arguments = function.get("arguments", "{}")
    return tool_turns.call_turn(where, call.get("id") or "", function.get("name"), arguments)


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


def _api_error(error: ToolError) -> ApiError:
    return ApiError(400, str(error), param=error.param)


def render(messages: list[ChatMessage], plan: Optional[ToolPlan], tokenizer: Tokenizer) -> str:
    """The prompt's text: the conversation and the plan's tools, rendered."""
    try:
        return tool_turns.render(conversation(messages), plan, tokenizer)
    except ToolError as error:
        raise _api_error(error) from None


def plan_tools(body: ChatCompletionRequest, auto_parser: Optional[str]) -> Optional[ToolPlan]:
    """The body's ToolPlan (None without tools); see tool_requests.plan_tools."""
    grammar_param = structured_param(body)
    try:
        return tool_requests.plan_tools(
            body.tools, body.tool_choice, body.parallel_tool_calls, grammar_param, auto_parser
        )
    except ToolError as error:
        raise _api_error(error) from None


def template_options(body: ChatCompletionRequest) -> Optional[ChatTemplateOptions]:
    """How the body asks its conversation rendered; None for the plain rendering."""
    kwargs = body.chat_template_kwargs or {}
    if body.add_generation_prompt and not body.continue_final_message and not kwargs:
        return None
    for name in kwargs:
        if name in _RESERVED_TEMPLATE_NAMES:
            raise ApiError(
                400,
                f"chat_template_kwargs.{name}: reserved (the server passes it to the template)",
                param="chat_template_kwargs",
            )
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise ApiError(
                400,
                "continue_final_message: needs add_generation_prompt set to false",
                param="continue_final_message",
            )
        last = body.messages[-1] if body.messages else None
        if last is None or last.role != "assistant" or not _text(len(body.messages) - 1, last):
            raise ApiError(
                400,
                "continue_final_message: the last message must be an assistant's, with content",
                param="continue_final_message",
            )
    return ChatTemplateOptions(body.add_generation_prompt, body.continue_final_message, kwargs)


def chat_request_pb(
    body: ChatCompletionRequest, auto_parser: Optional[str], tokenizer: Tokenizer
) -> tuple[generate_pb2.GenerateRequest, Optional[ToolPlan]]:
    """A chat body's public request and its tool plan (None without tools): with tools, tool
    turns or template options its prompt is rendered here; "required" or a named function adds
    its calls' grammar."""
    plan = plan_tools(body, auto_parser)
    options = template_options(body)
    ids = None
    if plan is not None or has_tool_turns(body.messages) or options is not None:
        try:
            ids = tool_turns.prompt_ids(conversation(body.messages), plan, tokenizer, options)
        except ToolError as error:
            raise _api_error(error) from None
    pb = to_pb(body, uuid.uuid4().hex, ids)
    schema = plan.grammar_schema() if plan is not None else None
    if schema is not None:
        pb.structured_output.json_schema = json.dumps(schema, ensure_ascii=False)
    return pb, plan
