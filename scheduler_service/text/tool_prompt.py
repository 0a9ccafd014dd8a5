"""planserve's default tool format, for chat templates with no place for tools.

A template that reads `tools` (as transformers' `apply_chat_template(tools=...)` passes them)
renders the tools, the calls and the results itself. Many do not (SmolLM2's has no tools, no
`tool` role): for those, the conversation is rewritten into plain system/user/assistant turns
in the Hermes format, which the `hermes` parser reads back and which Qwen2.5 and Hermes models
were trained on:

    system      <the request's system text, if any, then a blank line>
                # Tools
                ... <tools>
                {"type": "function", "function": {...}}      one line per tool
                </tools> ... how to call: <tool_call>{"name": ..., "arguments": ...}</tool_call>
    assistant   <its text, if any>
                <tool_call>
                {"name": "get_weather", "arguments": {"city": "Paris"}}
                </tool_call>                                   one block per call
    user        <tool_response>
                <the tool's result>
                </tool_response>                               consecutive tool messages joined
"""

from __future__ import annotations

import json
from typing import Any, Optional

TOOLS_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_block(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def _call_block(call: dict[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def default_format(
    messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]
) -> list[dict[str, str]]:
    """The conversation (OpenAI-shaped dicts: tool_calls on assistant turns, `tool` turns) as
    plain {"role", "content"} turns in the default tool format."""
    turns: list[dict[str, str]] = []
    rest = messages
    if tools:
        system = ""
        if messages and messages[0]["role"] == "system":
            system, rest = messages[0]["content"] + "\n\n", messages[1:]
        turns.append({"role": "system", "content": system + tools_block(tools)})
    for message in rest:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if turns and turns[-1].get("tool_results") == "yes":
                turns[-1]["content"] += "\n" + block
            else:
                turns.append({"role": "user", "content": block, "tool_results": "yes"})
            continue
        calls = [_call_block(call) for call in message.get("tool_calls") or ()]
        text = "\n".join(([content] if content else []) + calls)
        turns.append({"role": role, "content": text})
    return [{"role": turn["role"], "content": turn["content"]} for turn in turns]
