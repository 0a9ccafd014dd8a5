"""The tool-call parsers (text/tool_parsers) against outputs written by hand in each family's
format: several calls, malformed JSON, text before and after; and the split into content and
calls (api/chat_outputs.py) fed the same outputs whole and cut into stream chunks at every
place, which must give the same content and calls."""

from __future__ import annotations

import json

import pytest

from scheduler_service.api.chat_outputs import ChatOutput
from scheduler_service.api.tool_requests import ToolPlan
from scheduler_service.core.request import FinishReason
from scheduler_service.text import tool_parsers
from scheduler_service.text.tool_parsers import ToolCall, ToolParser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
CALL_WEATHER = ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')
CALL_TIME = ToolCall("get_time", '{"zone": "CET"}')

# (parser, output, content, calls)
CASES = [
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", "", [CALL_WEATHER]),
    (
        "hermes",
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
        "Let me check.\n",
        [CALL_WEATHER, CALL_TIME],
    ),
    (
        "hermes",
        f"<tool_call>{WEATHER}</tool_call> and that is all.",
        " and that is all.",
        [CALL_WEATHER],
    ),
    ("hermes", f"<tool_call>\n{TIME}", "", [CALL_TIME]),  # the model ended on the call
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {</tool_call>',
        '<tool_call>{"name": "f", "arguments": {</tool_call>',
        [],
    ),  # malformed: content
    (
        "hermes",
        f'<tool_call>{{"arguments": {{}}}}</tool_call><tool_call>{TIME}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [CALL_TIME],
    ),  # one without a name
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}',
        "",
        [CALL_WEATHER],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
        '"days": [1, 2]}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
        [CALL_WEATHER, CALL_TIME],
    ),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {"zone": ',
        '{"name": "get_time", "parameters": {"zone": ',
        [],
    ),
    (
        "llama3_json",
        'Sure: {"name": "get_time", "parameters": {}}',
        'Sure: {"name": "get_time", "parameters": {}}',
        [],
    ),  # text first: not this format
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {"zone": "CET"}} trailing words',
        '{"name": "get_time", "parameters": {"zone": "CET"}} trailing words',
        [],
    ),
    ("mistral", f"[TOOL_CALLS][{WEATHER}, {TIME}]", "", [CALL_WEATHER, CALL_TIME]),
    ("mistral", f"I will look it up.[TOOL_CALLS][{TIME}]", "I will look it up.", [CALL_TIME]),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}',
        [],
    ),
    ("mistral", "Plain [TOOL] text.", "Plain [TOOL] text.", []),
    (
        "pythonic",
        '[get_weather(city="Paris", days=[1, 2]), get_time(zone="CET")]',
        "",
        [CALL_WEATHER, CALL_TIME],
    ),
    ("pythonic", '<|python_start|>[get_time(zone="CET")]<|python_end|>', "", [CALL_TIME]),
    (
        "pythonic",
        '[get_time(zone="CET", dst=true, offset=null)]',
        "",
        [ToolCall("get_time", '{"zone": "CET", "dst": true, "offset": null}')],
    ),
    ("pythonic", '[get_time(zone="CET"', '[get_time(zone="CET"', []),  # cut: content
    ("pythonic", '[get_time("CET")]', '[get_time("CET")]', []),  # positional: not a call
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", 'Calling [get_time(zone="CET")]', 'Calling [get_time(zone="CET")]', []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_reads_a_whole_output(name, text, content, calls):
    parsed = tool_parsers.create(name).parse(text)
    assert parsed.content == content
    assert list(parsed.calls) == calls
    for call in parsed.calls:  # arguments are always a JSON object's text
        assert isinstance(json.loads(call.arguments), dict)


def _auto(name: str) -> ChatOutput:
    plan = ToolPlan("auto", ({"name": "get_weather"}, {"name": "get_time"}))
    return ChatOutput(plan, tool_parsers.create(name))


def _streamed(name: str, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    """The content and calls of an output fed in chunks, as the streamed response sends them:
    content deltas while it comes, then the held rest and the calls at the end."""
    split = _auto(name)
    deltas = []
    for number, chunk in enumerate(chunks):
        last = number == len(chunks) - 1
        deltas += split.deltas(chunk, FinishReason.EOS if last else None)
    content = "".join(delta.get("content", "") for delta in deltas)
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    arguments = [
        d["tool_calls"][0]["function"]["arguments"]
        for d in deltas
        if "tool_calls" in d and "id" not in d["tool_calls"][0]
    ]
    assert [head["index"] for head in heads] == list(range(len(heads)))
    return content, [ToolCall(h["function"]["name"], a) for h, a in zip(heads, arguments)]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_split_equals_the_whole_one_wherever_the_chunks_break(name, text, content, calls):
    whole = _auto(name).message(text, FinishReason.EOS)
    assert (whole["content"] or "") == content
    assert [
        ToolCall(c["function"]["name"], c["function"]["arguments"])
        for c in whole.get("tool_calls", [])
    ] == calls
    for cut in range(len(text) + 1):  # two chunks, broken at every character
        assert _streamed(name, [text[:cut], text[cut:]]) == (content, calls)
    assert _streamed(name, list(text)) == (content, calls)  # one character per chunk


def test_content_before_a_call_streams_before_the_output_ends():
    split = _auto("hermes")
    assert split.feed("Let me check the weather. <tool") == "Let me check the weather. "
    assert split.feed('_call>\n{"name":') == ""  # inside a call: held
    assert split.feed(' "get_time", "arguments": {}}\n</tool_call>') == ""
    assert split.finish(FinishReason.EOS) == ""
    assert split.calls == (ToolCall("get_time", "{}"),)


def test_an_output_cut_by_max_tokens_is_text_and_keeps_its_finish_reason():
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    split = _auto("hermes")
    message = split.message(text, FinishReason.LENGTH)
    assert message == {"role": "assistant", "content": text}
    assert split.finish_reason(FinishReason.LENGTH) == "length"
    done = _auto("hermes")
    done.message(text, FinishReason.EOS)
    assert done.finish_reason(FinishReason.EOS) == "tool_calls"


def test_guided_outputs_become_calls_only_when_complete():
    plan = ToolPlan("required", ({"name": "get_time"},))
    split = ChatOutput(plan, None)
    message = split.message(
        '[{"name": "get_time", "arguments": {"zone": "CET"}}]', FinishReason.EOS
    )
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {
        "name": "get_time",
        "arguments": '{"zone": "CET"}',
    }
    assert message["tool_calls"][0]["id"].startswith("call_")
    cut = ChatOutput(plan, None).message('[{"name": "get_time", "argum', FinishReason.LENGTH)
    assert cut == {"role": "assistant", "content": '[{"name": "get_time", "argum'}
    named = ChatOutput(ToolPlan("function", ({"name": "get_time"},), "get_time"), None)
    assert named.message('{"zone": "UTC"}', FinishReason.EOS)["tool_calls"][0]["function"] == {
        "name": "get_time",
        "arguments": '{"zone": "UTC"}',
    }
    none = ChatOutput(ToolPlan("none", ({"name": "get_time"},)), None)
    assert "tool_calls" not in none.message(f"<tool_call>{TIME}</tool_call>", FinishReason.EOS)


def test_mistral_call_ids_are_nine_letters_and_digits():
    call_id = tool_parsers.create("mistral").new_call_id()
    assert len(call_id) == 9 and call_id.isalnum()


class _Shouting(ToolParser):
    """A plugin parser: CALL name at the start of the output."""

    name = "shouting"

    def hold_from(self, text: str) -> int:
        return 0

    def parse(self, text: str):
        from scheduler_service.text.tool_parsers import Parsed

        if text.startswith("CALL "):
            return Parsed("", (ToolCall(text[5:].strip(), "{}"),))
        return Parsed(text)


def test_a_parser_resolves_by_name_or_dotted_path_and_unknown_names_list_the_valid_ones():
    assert type(tool_parsers.create("hermes")).__name__ == "HermesParser"
    plugin = tool_parsers.resolve(f"{__name__}:_Shouting")
    assert plugin is _Shouting
    assert plugin().parse("CALL ping").calls == (ToolCall("ping", "{}"),)
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        tool_parsers.resolve("qwen9")
    with pytest.raises(ValueError, match="not a ToolParser subclass"):
        tool_parsers.resolve("json:dumps")


def test_the_config_checks_the_parser_and_that_auto_has_one():
    from scheduler_service.config import SchedulerConfig

    SchedulerConfig(enable_auto_tool_choice=True, tool_call_parser="pythonic").validate()
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs tool_call_parser"):
        SchedulerConfig(enable_auto_tool_choice=True).validate()
    with pytest.raises(ValueError, match="unknown tool parser 'qwen9'; valid: hermes"):
        SchedulerConfig(tool_call_parser="qwen9").validate()


def test_the_flags_are_the_config_fields():
    import argparse

    from scheduler_service.cli import add_scheduler_flags

    parser = argparse.ArgumentParser()
    add_scheduler_flags(parser)
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "mistral")
