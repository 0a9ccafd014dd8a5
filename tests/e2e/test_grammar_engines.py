"""Both grammar engines end to end (`--grammar-engine llguidance`, the default, and `outlines`):
the tiny server, with each as its grammar engine, serves structured output and forced tool calls
through the official `openai` client alike (valid under the schema, only the declared keys of
objects that leave additionalProperties unset, the regex matched, a cut call left as text), and
leaves nothing behind."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import openai
import pytest_asyncio
from api import assert_no_leaked_blocks, wait_until_idle

from scheduler_service.text.structured import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "enum": ["CET", "UTC", "PST"]},
        "hours": {"type": "array", "items": {"type": "integer", "enum": [1, 2, 24]}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["zone", "hours", "where"],
    # No additionalProperties here: both engines give only the declared keys.
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": SCHEMA}}]
ASK = [{"role": "user", "content": "What time is it in Berlin?"}]


def _valid(arguments: str) -> None:
    document = json.loads(arguments)
    jsonschema.validate(document, SCHEMA)
    assert set(document) <= set(SCHEMA["properties"]), document


@pytest_asyncio.fixture(params=["llguidance", "outlines"])
async def engine_server(tiny_server, request):
    """The tiny server with a fresh compiler of one engine (what --grammar-engine builds at
    start), for one test: the model service allows one scheduler at a time."""
    serving = tiny_server.admission.serving
    facts = serving.facts
    grammars = GrammarCompiler(
        facts.tokenizer_json, facts.eos_token_ids, facts.vocab_size, engine=request.param
    )
    tiny_server.admission.serving = dataclasses.replace(serving, grammars=grammars)
    try:
        yield tiny_server
    finally:
        tiny_server.admission.serving = serving


async def test_each_engine_serves_schemas_regexes_and_forced_calls(engine_server):
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{engine_server.http_port}/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
    )
    model = engine_server.servicer.serving.facts.model_name
    for seed in range(3):
        named = await client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            max_tokens=120,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        assert named.choices[0].finish_reason == "tool_calls", named.choices[0]
        [call] = named.choices[0].message.tool_calls
        _valid(call.function.arguments)
        required = await client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            max_tokens=160,
            seed=seed,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        assert required.choices[0].finish_reason == "tool_calls"
        for call in required.choices[0].message.tool_calls:
            _valid(call.function.arguments)
        regex = await client.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=30,
            seed=seed,
            extra_body={"guided_regex": r"[a-z]{3,8}@example\.(com|org)"},
        )
        assert re.fullmatch(r"[a-z]{3,8}@example\.(com|org)", regex.choices[0].message.content)
    cut = await client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        max_tokens=5,
        seed=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    await wait_until_idle(engine_server)
    assert_no_leaked_blocks(engine_server)
    assert engine_server.admission.serving.grammars.num_compiled >= 3  # compiled by this engine
