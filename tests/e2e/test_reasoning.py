"""--reasoning-parser on /v1/chat/completions through the official `openai` client: the tiny
model's output is forced into a think block and an answer (guided_regex, Qwen3's markers), and
the server splits it into `reasoning_content` and `content`, streamed and not."""

from __future__ import annotations

import dataclasses
import re

import openai
import pytest
from api import assert_no_leaked_blocks, wait_until_idle

from scheduler_service.api.http_server import HttpServer

THINKING = r"<think>\n[a-z]{3,8}( [a-z]{3,8}){1,3}\n</think>\n\n(Yes|No)\."
ASK = [{"role": "user", "content": "Is it raining?"}]


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


async def test_qwen3_think_block_goes_to_reasoning_content_streamed_or_not(tiny_server):
    http, client = await _door(tiny_server, "qwen3")
    try:
        kwargs = dict(
            model=_model(tiny_server),
            messages=ASK,
            max_tokens=60,
            seed=2,
            extra_body={"guided_regex": THINKING},
        )
        result = await client.chat.completions.create(**kwargs)
        message = result.choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert re.fullmatch(r"\n[a-z]{3,8}( [a-z]{3,8}){1,3}\n", reasoning), reasoning
        assert message.content in ("\n\nYes.", "\n\nNo.")
        assert result.choices[0].finish_reason == "stop"
        streamed = await _streamed(client, **kwargs)
        assert streamed == (reasoning, message.content, ["stop"])
        cut = await client.chat.completions.create(**dict(kwargs, max_tokens=8))
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
        # A grammar binds the first token: no think block, the output is all content.
        constrained = await client.chat.completions.create(
            model=_model(tiny_server),
            messages=ASK,
            max_tokens=20,
            seed=1,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "a",
                    "schema": {
                        "type": "object",
                        "properties": {"ok": {"type": "boolean"}},
                        "required": ["ok"],
                    },
                },
            },
        )
        constrained_message = constrained.choices[0].message
        assert constrained_message.content.startswith("{")
        assert constrained_message.model_extra.get("reasoning_content") is None
    finally:
        await http.stop(grace_s=1)


@pytest.mark.parametrize("parser", ["o1"])
def test_an_unknown_reasoning_parser_is_refused_naming_the_field(parser):
    from scheduler_service.config import SchedulerConfig

    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        SchedulerConfig(reasoning_parser=parser).validate()
