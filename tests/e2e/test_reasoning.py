"""--reasoning-parser on /v1/chat/completions through the official `openai` client. The tiny
random model is pushed onto the pieces of Qwen3's markers with logit_bias (it writes them in a
random order until it happens to close the block): the think block goes to `reasoning_content`,
the answer to `content`, streamed and not; a grammar (guided_regex, response_format, a named
tool) constrains only what follows `</think>`, so the thinking stays free (it is made of marker
pieces no grammar here allows). Under qwen3 the grammar's first mask also lets the output open
a block, which the bias on `<` makes it do."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import openai
import pytest
from api import assert_no_leaked_blocks, wait_until_idle

from scheduler_service.api.http_server import HttpServer

ANSWER = r"\n\n(Yes|No)\."
ASK = [{"role": "user", "content": "Is it raining?"}]
PIECES = re.compile(r"(<|</|think|>)+")  # what the biased thinking is made of
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "zone": {"enum": ["CET", "UTC"]}},
    "required": ["ok", "zone"],
}


def _bias(server, *markers: str) -> dict[str, int]:
    """logit_bias pushing the model onto the markers' tokens (the tokenizer's own ids)."""
    tokenizer = server.servicer.serving.tokenizer
    ids = {i for marker in markers for i in tokenizer.encode(marker, add_special_tokens=False)}
    return {str(i): 100 for i in ids}


async def _door(server, parser: str):
    config = dataclasses.replace(server.config, reasoning_parser=parser)
    http = HttpServer(server.admission, "127.0.0.1", 0, config=config)
    port = await http.start()
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120
    )
    return http, client


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


async def _streamed(client, **kwargs) -> tuple[str, str, list[str]]:
    reasoning, content, reasons = [], [], []
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(choice.delta.content or "")
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return "".join(reasoning), "".join(content), reasons


async def test_qwen3_think_block_is_free_and_the_grammar_applies_after_it(tiny_server):
    bias = _bias(tiny_server, "<think>", "</think>")
    http, client = await _door(tiny_server, "qwen3")
    try:
        kwargs = dict(
            model=_model(tiny_server),
            messages=ASK,
            max_tokens=400,
            seed=1,
            logit_bias=bias,
            extra_body={"guided_regex": ANSWER},
        )
        result = await client.chat.completions.create(**kwargs)
        message = result.choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert PIECES.fullmatch(reasoning) and "</think>" not in reasoning, reasoning
        assert message.content in ("\n\nYes.", "\n\nNo.")
        assert result.choices[0].finish_reason == "stop"
        streamed = await _streamed(client, **kwargs)
        assert streamed == (reasoning, message.content, ["stop"])
        cut = await client.chat.completions.create(**dict(kwargs, max_tokens=4))
        cut_message = cut.choices[0].message
        assert cut.choices[0].finish_reason == "length"
        assert cut_message.content == "" and cut_message.model_extra["reasoning_content"]
    finally:
        await http.stop(grace_s=1)
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_deepseek_r1_reads_the_output_as_reasoning_until_the_block_ends(tiny_server):
    plain = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
    )
    kwargs = dict(
        model=_model(tiny_server),
        messages=ASK,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    unsplit = (await plain.chat.completions.create(**kwargs)).choices[0].message.content
    http, client = await _door(tiny_server, "deepseek_r1")
    try:
        message = (await client.chat.completions.create(**kwargs)).choices[0].message
        # The tiny model never writes </think>: a block cut by max_tokens stays reasoning.
        assert "</think>" not in unsplit
        assert (message.model_extra["reasoning_content"], message.content) == (unsplit, "")
        assert await _streamed(client, **kwargs) == (unsplit, "", ["length"])
    finally:
        await http.stop(grace_s=1)


async def test_deepseek_r1_applies_a_schema_or_a_named_tool_after_the_thinking(tiny_server):
    http, client = await _door(tiny_server, "deepseek_r1")
    tool = {"type": "function", "function": {"name": "report", "parameters": SCHEMA}}
    common = dict(
        model=_model(tiny_server),
        messages=ASK,
        max_tokens=300,
        logit_bias=_bias(tiny_server, "</think>"),
    )
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    try:
        for seed in range(3):
            kwargs = dict(common, seed=seed, response_format=response_format)
            message = (await client.chat.completions.create(**kwargs)).choices[0].message
            reasoning = message.model_extra["reasoning_content"]
            assert PIECES.fullmatch(reasoning) and "</think>" not in reasoning, reasoning
            jsonschema.validate(json.loads(message.content), SCHEMA)
            assert await _streamed(client, **kwargs) == (reasoning, message.content, ["stop"])
            named = {"type": "function", "function": {"name": "report"}}
            kwargs = dict(common, seed=seed, tools=[tool], tool_choice=named)
            called = (await client.chat.completions.create(**kwargs)).choices[0]
            assert called.finish_reason == "tool_calls"
            assert PIECES.fullmatch(called.message.model_extra["reasoning_content"])
            [call] = called.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    finally:
        await http.stop(grace_s=1)


@pytest.mark.parametrize("parser", ["o1"])
def test_an_unknown_reasoning_parser_is_refused_naming_the_field(parser):
    from scheduler_service.config import SchedulerConfig

    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        SchedulerConfig(reasoning_parser=parser).validate()
