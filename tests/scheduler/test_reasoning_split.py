"""Think blocks split from answers (text/reasoning.py) on outputs written by hand in Qwen3's
and DeepSeek-R1's markers: whole, and cut into stream chunks at every place (the same split)."""

from __future__ import annotations

import pytest

from scheduler_service.api.chat_outputs import ChatOutput
from scheduler_service.api.tool_requests import ToolPlan
from scheduler_service.core.request import FinishReason
from scheduler_service.text import tool_parsers
from scheduler_service.text.reasoning import ReasoningSplit

# (parser, output, reasoning, content)
CASES = [
    ("qwen3", "<think>\n2 < 3, so yes.\n</think>\n\nYes.", "\n2 < 3, so yes.\n", "\n\nYes."),
    ("qwen3", "  <think>x</think>y", "x", "y"),
    ("qwen3", "Yes, no thinking.", "", "Yes, no thinking."),  # thinking off
    ("qwen3", "Not a block: </think> here", "", "Not a block: </think> here"),
    ("qwen3", "<think>cut by max_tokens </thi", "cut by max_tokens </thi", ""),
    ("deepseek_r1", "Let me see.\n</think>\n\nFour.", "Let me see.\n", "\n\nFour."),
    ("deepseek_r1", "<think>again</think>Four.", "again", "Four."),
    ("deepseek_r1", "never ends", "never ends", ""),
    ("deepseek_r1", "</think>", "", ""),
]


def _split(parser: str, chunks: list[str]) -> tuple[str, str]:
    split = ReasoningSplit(parser)
    parts = [split.feed(chunk) for chunk in chunks] + [split.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_the_split_is_the_same_whole_or_cut_anywhere(parser, text, reasoning, content):
    assert _split(parser, [text]) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _split(parser, [text[:cut], text[cut:]]) == (reasoning, content)
    assert _split(parser, list(text)) == (reasoning, content)


def test_reasoning_streams_before_the_block_ends():
    split = ReasoningSplit("qwen3")
    assert split.feed("<think>I am thinking</th") == ("I am thinking", "")
    assert split.feed("ink>\n\nDone") == ("", "\n\nDone")


def test_tool_calls_are_read_from_the_content_after_the_think_block():
    plan = ToolPlan("auto", ({"name": "get_time"},))
    output = ChatOutput(plan, tool_parsers.create("hermes"), ReasoningSplit("qwen3"))
    text = (
        '<think>I should call <tool_call>{"name": "nope"}</tool_call>.</think>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    message = output.message(text, FinishReason.EOS)
    assert message["reasoning_content"] == 'I should call <tool_call>{"name": "nope"}</tool_call>.'
    assert message["content"] is None
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_time"]


def test_an_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        ReasoningSplit("o1")


def test_a_grammar_waits_for_the_end_of_thinking_unless_the_prompt_closed_it():
    from scheduler_service.text.reasoning import grammar_after

    none = (b"", b"")
    assert grammar_after("", "<|im_start|>assistant\n") == none  # no reasoning parser
    # qwen3: the output may open a block; deepseek_r1: the template opened it.
    assert grammar_after("qwen3", "<|im_start|>assistant\n") == (b"</think>", b"<think>")
    assert grammar_after("deepseek_r1", "<｜Assistant｜><think>\n") == (b"</think>", b"")
    # Qwen3 with enable_thinking=False: the template wrote an empty, closed block.
    assert grammar_after("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n") == none
    # A closed block of an earlier turn, then a new one opened by the template.
    tail = "<think>a</think>b<｜Assistant｜><think>\n"
    assert grammar_after("deepseek_r1", tail) == (b"</think>", b"")
