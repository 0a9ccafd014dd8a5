"""Anthropic's Messages API body, read as the chat request it is, and its answer's shapes.

A /v1/messages body becomes a `ChatCompletionRequest` (so it is admitted, rendered and split
exactly as a chat completion is); the split sample comes back as Anthropic content blocks:

    Anthropic                                   chat completion
    system (text or text blocks)                a system message
    user: text / tool_result blocks             user message / `tool` messages
    assistant: text / tool_use blocks           assistant message with `tool_calls`
    tools[{name, description, input_schema}]    tools[{type: function, function: {..., parameters}}]
    tool_choice auto / any / tool / none        "auto" / "required" / a named function / "none"
    disable_parallel_tool_use                   parallel_tool_calls false
    stop_sequences                              stop
    a last assistant message (a prefill)        continue_final_message, so the reply goes
                                                on from it (and holds only what follows)
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from scheduler_service.api.openai_errors import ApiError
from scheduler_service.api.openai_requests import ChatCompletionRequest
from scheduler_service.core.request import FinishReason

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
STOP_REASONS = {  # a finish reason -> Anthropic's stop_reason (tool_use: calls were made)
    FinishReason.EOS: "end_turn",
    FinishReason.STOP: "stop_sequence",
    FinishReason.LENGTH: "max_tokens",
}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, thinking, ...: accepted and ignored

    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: bool = False


def _text(where: str, content: Any) -> str:
    """Text, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: must be a string or a list of blocks", param="messages")
    texts = []
    for index, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else block
            raise ApiError(
                400, f"{where}[{index}]: only text blocks here, got {kind!r}", param="messages"
            )
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _turns(index: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (tool results become `tool` messages)."""
    where, role = f"messages[{index}]", message.get("role")
    if role not in ("user", "assistant"):
        raise ApiError(
            400, f"{where}.role: must be user or assistant, got {role!r}", param="messages"
        )
    content = message.get("content", "")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for number, block in enumerate(content if isinstance(content, list) else [None]):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            function = {"name": block.get("name"), "arguments": arguments}
            calls.append({"id": block.get("id"), "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            result = _text(f"{where}.content[{number}].content", block.get("content", ""))
            turns.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result}
            )
        else:
            raise ApiError(
                400,
                f"{where}.content[{number}]: a {role} message takes text"
                f"{', tool_use' if role == 'assistant' else ', tool_result'} blocks, got {kind!r}",
                param="messages",
            )
    if texts or calls:
        turn: dict[str, Any] = {"role": role, "content": "".join(texts) or None}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


def _tool_choice(choice: Optional[dict[str, Any]]) -> tuple[Any, Optional[bool]]:
    """(chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    if kind not in _TOOL_CHOICES:
        raise ApiError(
            400,
            f"tool_choice.type: must be auto, any, tool or none, got {kind!r}",
            param="tool_choice",
        )
    return _TOOL_CHOICES[kind], parallel


def _tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(tool, dict) or "input_schema" not in tool:
        raise ApiError(400, f"tools[{index}].input_schema: required", param="tools")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages body is."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text("system", body.system)})
    for index, message in enumerate(body.messages):
        messages += _turns(index, message)
    tool_choice, parallel = _tool_choice(body.tool_choice)
    tools = [_tool(index, tool) for index, tool in enumerate(body.tools or ())] or None
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
        "tools": tools,
        "tool_choice": tool_choice if tools or tool_choice not in (None, "none") else None,
        "parallel_tool_calls": parallel,
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
        if (last["content"] or "").strip():
            chat["add_generation_prompt"], chat["continue_final_message"] = False, True
        else:  # an empty one prefills nothing (Anthropic's API allows it last): a new turn
            messages.pop()
    try:
        return ChatCompletionRequest.model_validate(
            {key: value for key, value in chat.items() if value is not None}
        )
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=str(first["loc"][0])) from None


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (chat_outputs.ChatOutput.message) as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(),
                "name": function["name"],
                "input": json.loads(function["arguments"]),
            }
        )
    return blocks


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def stop_reason(reason: Optional[FinishReason], called: bool) -> Optional[str]:
    if called:
        return "tool_use"
    return STOP_REASONS.get(reason, "end_turn") if reason is not None else None
