"""OpenAI's Responses API body, read as the chat request it is, and its output items.

A /v1/responses body becomes a `ChatCompletionRequest` (admitted, rendered and split exactly as a
chat completion is); the split sample comes back as output items:

    Responses                                          chat completion
    instructions                                       a system message
    input: a string                                    one user message
    input items: {role, content: text or input_text}   messages
    {type: function_call, call_id, name, arguments}    an assistant message's tool_calls
    {type: function_call_output, call_id, output}      a `tool` message
    tools[{type: function, name, parameters, ...}]     tools[{type: function, function: {...}}]
    tool_choice {type: function, name}                 {type: function, function: {name}}
    max_output_tokens                                  max_tokens

Stored state is not kept: `store: true` and `previous_response_id` are refused (400), so earlier
outputs are given back as input items instead.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from scheduler_service.api.openai_errors import ApiError
from scheduler_service.api.openai_requests import ChatCompletionRequest

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, user, ...: accepted and ignored

    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None


def _text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content if isinstance(content, list) else [content]):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ApiError(
                400,
                f"{where}[{index}].type: only text parts are supported, got {kind!r}",
                param="input",
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive function calls share one assistant turn."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{index}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(
                    400,
                    f"{where}.role: must be user, assistant, system or developer, got {role!r}",
                    param="input",
                )
            messages.append(
                {"role": role, "content": _text(f"{where}.content", item.get("content", ""))}
            )
        elif kind == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            call = {"id": item.get("call_id"), "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = output if isinstance(output, str) else _text(f"{where}.output", output)
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": content}
            )
        elif kind != "reasoning":  # earlier reasoning given back: not part of the prompt
            raise ApiError(400, f"{where}.type: {kind!r} is not supported", param="input")
    return messages


def _tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise ApiError(
            400, f"tools[{index}].type: only function tools, got {kind!r}", param="tools"
        )
    function = {
        key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None
    }
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses body is; stored state is refused."""
    if body.store:
        raise ApiError(
            400, "store: stored responses are not kept; send false or leave it out", param="store"
        )
    if body.previous_response_id is not None:
        raise ApiError(
            400,
            "previous_response_id: stored responses are not kept; send earlier outputs as input",
            param="previous_response_id",
        )
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    messages += _messages(items)
    tools = [_tool(index, tool) for index, tool in enumerate(body.tools or ())] or None
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools,
        "tool_choice": _tool_choice(body.tool_choice)
        if tools or body.tool_choice not in (None, "none")
        else None,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None}
        )
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=str(first["loc"][0])) from None


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def message_item(
    text: str, item: Optional[str] = None, status: str = "completed"
) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item or item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def reasoning_item(text: str, item: Optional[str] = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item or item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(
    call: dict[str, Any], item: Optional[str] = None, status: str = "completed"
) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "function_call",
        "id": item or item_id("fc"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (chat_outputs.ChatOutput.message) as Responses output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    items += [call_item(call) for call in message.get("tool_calls") or ()]
    return items
