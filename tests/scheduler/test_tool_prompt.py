"""A conversation with tools to its prompt (api/chat_prompt.py): a chat template that reads
`tools` renders them itself, with each call's arguments as an object (transformers' convention);
a template without tools (SmolLM2's) gets planserve's default tool format (text/tool_prompt.py)."""

from __future__ import annotations

import json

import pytest
import tokenizers
from tokenizers import models

from scheduler_service.api.chat_prompt import render
from scheduler_service.api.openai_errors import ApiError
from scheduler_service.api.openai_requests import ChatMessage
from scheduler_service.api.tool_requests import ToolPlan
from scheduler_service.text.tokenizer import Tokenizer

SMOLLM2_TEMPLATE = (  # SmolLM2-Instruct's, as its GGUF ships it: no tools, no tool role
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS_TEMPLATE = (  # a template that reads tools, as Qwen2.5's does (shortened)
    "{% if tools %}[tools]{% for tool in tools %}{{ tool.function.name }};{% endfor %}\n"
    "{% endif %}{% for m in messages %}{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}[call {{ c.id }}] {{ c.function.name }} "
    "{{ c.function.arguments.zone }}\n{% endfor %}{% elif m.role == 'tool' %}"
    "[result {{ m.tool_call_id }}] {{ m.content }}\n{% else %}[{{ m.role }}] {{ m.content }}\n"
    "{% endif %}{% endfor %}[assistant]"
)
FUNCTION = {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
}
PLAN = ToolPlan("auto", (FUNCTION,))
HISTORY = [
    ChatMessage(role="user", content="Time in Berlin?"),
    ChatMessage(
        role="assistant",
        content=None,
        tool_calls=[
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            }
        ],
    ),
    ChatMessage(role="tool", tool_call_id="call_7", content="14:05"),
]


def _tokenizer(template: str) -> Tokenizer:
    vocab = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).to_str()
    return Tokenizer(vocab, template, {})


def test_a_template_that_reads_tools_renders_them_and_the_calls_arguments_as_objects():
    text = render(HISTORY, PLAN, _tokenizer(TOOLS_TEMPLATE))
    assert text == (
        "[tools]get_time;[user] Time in Berlin?\n[call call_7] get_time CET\n"
        "[result call_7] 14:05\n[assistant]"
    )


def test_smollm2s_template_gets_the_default_tool_format():
    text = render(
        [ChatMessage(role="system", content="Be brief.")] + HISTORY,
        PLAN,
        _tokenizer(SMOLLM2_TEMPLATE),
    )
    tool_line = json.dumps({"type": "function", "function": FUNCTION})
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{tool_line}\n</tools>" in text
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n14:05\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    assert "SmolLM" not in text  # the tools' system turn replaces the template's default


def test_consecutive_tool_results_share_one_user_turn():
    results = HISTORY + [ChatMessage(role="tool", tool_call_id="call_8", content="15:05")]
    text = render(results, None, _tokenizer(SMOLLM2_TEMPLATE))
    assert (
        "<|im_start|>user\n<tool_response>\n14:05\n</tool_response>\n<tool_response>\n"
        "15:05\n</tool_response><|im_end|>"
    ) in text
    assert "# Tools" not in text  # no tools offered in this request


def test_a_call_on_a_user_turn_or_an_unknown_role_is_refused_naming_the_message():
    bad_call = [ChatMessage(role="user", content="hi", tool_calls=HISTORY[1].tool_calls)]
    with pytest.raises(ApiError, match=r"messages\[0\]\.tool_calls: only on assistant"):
        render(bad_call, PLAN, _tokenizer(SMOLLM2_TEMPLATE))
    with pytest.raises(ApiError, match=r"messages\[0\]\.role"):
        render([ChatMessage(role="function", content="x")], PLAN, _tokenizer(SMOLLM2_TEMPLATE))
