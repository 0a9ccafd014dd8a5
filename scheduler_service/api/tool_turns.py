"""A conversation with tools, tool calls or tool results, rendered into its prompt, for every
door (the HTTP API's messages, gRPC's ChatMessages): each door turns its own messages into
chat template turns and gets the prompt's text or token ids from here.

The chat template renders the tools when it reads `tools` (transformers' convention: tools as
OpenAI's tool objects, an assistant turn's `tool_calls` with their arguments as objects, `tool`
turns with `tool_call_id`); otherwise the conversation is first rewritten in planserve's
default tool format (text/tool_prompt.py). A refusal is a `ToolError` naming `messages`.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import jinja2

from scheduler_service.api.tool_requests import ToolError, ToolPlan
from scheduler_service.text import tool_prompt
from scheduler_service.text.tokenizer import ChatTemplateOptions, Tokenizer


def call_turn(where: str, call_id: str, name: Any, arguments: Any) -> dict[str, Any]:
    """One call of an assistant turn as a template takes it; `arguments` as JSON text or an
    object, `where` its path in the request ("messages[1].tool_calls[0]")."""
    if not isinstance(name, str):
        raise ToolError("messages", f"{where}.function.name", "must be a string")
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as error:
        raise ToolError(
            "messages", f"{where}.function.arguments", f"not valid JSON ({error})"
        ) from None
    if not isinstance(decoded, dict):
        raise ToolError("messages", f"{where}.function.arguments", "must be a JSON object")
    # Templates write the arguments with `tojson`: an object, not its JSON text.
    function = {"name": name, "arguments": decoded}
    return {"id": call_id, "type": "function", "function": function}


def render(
    turns: list[dict[str, Any]],
    plan: Optional[ToolPlan],
    tokenizer: Tokenizer,
    options: Optional[ChatTemplateOptions] = None,
) -> str:
    """The prompt's text: the turns and the plan's tools, rendered as `options` asks."""
    tools = plan.tools if plan is not None else None
    if not tokenizer.has_chat_template:
        raise ToolError("messages", "messages", "the served model has no chat template")
    try:
        if tokenizer.supports_tools:
            return tokenizer.render_chat(turns, tools, options)
        return tokenizer.render_chat(tool_prompt.default_format(turns, tools), None, options)
    except (jinja2.TemplateError, ValueError) as error:
        raise ToolError(
            "messages", "messages", f"the chat template refused them ({error})"
        ) from None


def prompt_ids(
    turns: list[dict[str, Any]],
    plan: Optional[ToolPlan],
    tokenizer: Tokenizer,
    options: Optional[ChatTemplateOptions] = None,
) -> list[int]:
    """The prompt's token ids (the template wrote every special token it wants)."""
    return tokenizer.encode(render(turns, plan, tokenizer, options), add_special_tokens=False)
