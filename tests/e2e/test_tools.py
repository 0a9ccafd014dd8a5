"""Tool calling on /v1/chat/completions through the official `openai` client, against real
servers on 127.0.0.1: the tiny random model shows the mechanics (a grammar makes any model's
calls valid; "auto" reads what the model wrote with the server's parser; a cut call is text),
SmolLM2 (the default model) that its calls validate against nested schemas and that a
conversation with a call and its result goes on. Bad tools and tool_choice get a 400 naming
the parameter and leave nothing behind."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import jsonschema
import openai
import pytest
from api import assert_no_leaked_blocks, wait_until_idle
from conftest import FRONTEND_PROCESSES

from scheduler_service.api.http_server import HttpServer

ZONE_SCHEMA = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "enum": ["CET", "UTC", "PST"]},
        "hours": {"type": "integer", "enum": [1, 2, 24]},
        "dst": {"type": "boolean"},
    },
    "required": ["zone", "hours", "dst"],
}
NESTED_SCHEMA = {  # nested objects, enums, arrays, required fields
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "when": {
            "type": "object",
            "properties": {
                "day": {"type": "string", "enum": ["today", "tomorrow"]},
                "hours": {
                    "type": "array",
                    "items": {"type": "integer", "enum": [6, 12, 18]},
                    "maxItems": 3,
                },
            },
            "required": ["day", "hours"],
        },
    },
    "required": ["city", "unit", "when"],
}


def _tool(name: str, schema: dict, description: str = "") -> dict:
    function = {"name": name, "description": description, "parameters": schema}
    return {"type": "function", "function": function}


TOOLS = [
    _tool("get_time", ZONE_SCHEMA, "The time in a time zone"),
    _tool("get_weather", NESTED_SCHEMA, "The weather forecast for a city"),
]
ASK = [{"role": "user", "content": "What time is it in Berlin?"}]
HERMES_CALL = (  # a whole output in the hermes format, forced with guided_regex
    r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(CET|UTC)", '
    r'"hours": 1, "dst": (true|false)\}\}\n</tool_call>'
)


def _client(port: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300
    )


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


def _validated(call, schemas: dict[str, dict]) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schemas[call.function.name])
    assert call.type == "function" and call.id.startswith("call_")
    return arguments


SCHEMAS = {"get_time": ZONE_SCHEMA, "get_weather": NESTED_SCHEMA}


@pytest.fixture
def client(tiny_server):
    return _client(tiny_server.http_port)


@pytest.fixture
async def hermes_client(tiny_server):
    """The tiny server's engine behind a door with --enable-auto-tool-choice
    --tool-call-parser hermes."""
    config = dataclasses.replace(
        tiny_server.config, enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    http = HttpServer(tiny_server.admission, "127.0.0.1", 0, config=config)
    port = await http.start()
    yield _client(port)
    await http.stop(grace_s=1)


async def _streamed(client, **kwargs) -> tuple[str, list[dict], list[str]]:
    """(content, calls as {"id", "name", "arguments"}, finish reasons) of a streamed chat."""
    content, calls, reasons = [], {}, []
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for part in delta.tool_calls or ():
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                if part.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = part.id, part.function.name
                call["arguments"] += part.function.arguments or ""
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    return "".join(content), [calls[i] for i in sorted(calls)], reasons


async def test_required_gives_calls_valid_under_the_schema_streamed_or_not(tiny_server, client):
    kwargs = dict(
        model=_model(tiny_server),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        seed=5,
    )
    result = await client.chat.completions.create(**kwargs)
    [choice] = result.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    _validated(call, SCHEMAS)
    content, calls, reasons = await _streamed(client, **kwargs)
    assert content == "" and reasons == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (call.function.name, json.loads(call.function.arguments))
    ]
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_a_named_function_is_called_with_valid_arguments(tiny_server, client):
    for seed in range(3):
        result = await client.chat.completions.create(
            model=_model(tiny_server),
            messages=ASK,
            tools=TOOLS,
            max_tokens=60,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        [choice] = result.choices
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time"
        _validated(call, SCHEMAS)


async def test_a_call_cut_by_max_tokens_is_text_with_finish_reason_length(tiny_server, client):
    kwargs = dict(
        model=_model(tiny_server),
        messages=ASK,
        tools=TOOLS,
        max_tokens=6,
        seed=5,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    result = await client.chat.completions.create(**kwargs)
    [choice] = result.choices
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.message.content.startswith("{")
    content, calls, reasons = await _streamed(client, **kwargs)
    assert (content, calls, reasons) == (choice.message.content, [], ["length"])


async def test_none_never_returns_tool_calls(tiny_server, hermes_client):
    # The output is forced into the hermes format, yet "none" does not read it for calls.
    result = await hermes_client.chat.completions.create(
        model=_model(tiny_server),
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=80,
        seed=1,
        extra_body={"guided_regex": HERMES_CALL},
    )
    [choice] = result.choices
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert "<tool_call>" in choice.message.content


async def test_auto_reads_the_models_calls_with_the_servers_parser(tiny_server, hermes_client):
    kwargs = dict(
        model=_model(tiny_server),
        messages=ASK,
        tools=TOOLS,
        max_tokens=80,
        seed=1,
        extra_body={"guided_regex": HERMES_CALL},
    )
    result = await hermes_client.chat.completions.create(**kwargs)  # tool_choice: auto
    [choice] = result.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure.\n"
    [call] = choice.message.tool_calls
    assert _validated(call, SCHEMAS)["hours"] == 1
    content, calls, reasons = await _streamed(hermes_client, **kwargs)
    assert content == "Sure.\n" and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]
    cut = await hermes_client.chat.completions.create(**dict(kwargs, max_tokens=12))
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.tool_calls is None


async def test_a_history_with_a_call_and_its_result_goes_on(tiny_server, client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_time",
                        "arguments": '{"zone": "CET", "hours": 1, "dst": false}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
    ]
    without_result = await client.chat.completions.create(
        model=_model(tiny_server),
        messages=history[:2],
        max_tokens=4,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
    )
    result = await client.chat.completions.create(
        model=_model(tiny_server),
        messages=history,
        max_tokens=4,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
    )
    assert result.choices[0].message.content
    # The call and the result are in the prompt (planserve's default format for SmolLM2's
    # template): the tool turn adds its tokens.
    assert result.usage.prompt_tokens > without_result.usage.prompt_tokens + 5


BAD = [
    (
        {"tool_choice": {"type": "function", "function": {"name": "get_date"}}},
        "tool_choice",
        "no tool named 'get_date'",
    ),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be none, auto, required"),
    ({"tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({}, "tool_choice", "--enable-auto-tool-choice"),  # "auto" is the default with tools
    (
        {"tools": [_tool(f"t{i}", ZONE_SCHEMA) for i in range(129)], "tool_choice": "none"},
        "tools",
        "at most 128 tools, got 129",
    ),
    (
        {
            "tools": [_tool("big", {"type": "object", "description": "x" * 40000})],
            "tool_choice": "none",
        },
        "tools",
        "at most 32768 characters",
    ),
    (
        {"tools": [_tool("bad name!", ZONE_SCHEMA)], "tool_choice": "none"},
        "tools",
        "tools[0].function.name",
    ),
    (
        {"tools": [_tool("a", ZONE_SCHEMA), _tool("a", ZONE_SCHEMA)], "tool_choice": "none"},
        "tools",
        "named twice",
    ),
    (
        {
            "tools": [_tool("f", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})],
            "tool_choice": "required",
        },
        "tools",
        "cannot be compiled",
    ),
    (
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "cannot be combined",
    ),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {
            "messages": ASK
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{oops"},
                        }
                    ],
                }
            ],
            "tool_choice": "none",
        },
        "messages",
        "messages[1].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize("overrides,param,words", BAD)
async def test_bad_tools_get_a_400_naming_the_parameter(
    tiny_server, client, overrides, param, words
):
    body = dict(model=_model(tiny_server), messages=ASK, tools=TOOLS, max_tokens=8)
    body.update(overrides)
    body = {key: value for key, value in body.items() if value is not None}
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(**body)
    error = raised.value.body
    assert error["param"] == param, error
    assert words in error["message"], error
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


@pytest.fixture
async def smollm2_client(smollm2_default_server):
    http = HttpServer(smollm2_default_server.admission, "127.0.0.1", 0)
    port = await http.start()
    yield _client(port)
    await http.stop(grace_s=1)


@pytest.mark.slow(reason="three SmolLM2 chat turns, two of them under a tool's JSON schema")
async def test_smollm2_required_and_named_calls_validate_and_the_conversation_goes_on(
    smollm2_default_server, smollm2_client
):
    model = _model(smollm2_default_server)
    ask = [{"role": "user", "content": "What will the weather be in Paris tomorrow?"}]
    required = await smollm2_client.chat.completions.create(
        model=model,
        messages=ask,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    [choice] = required.choices
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(_validated(call, SCHEMAS) is not None for call in calls)
    named = await smollm2_client.chat.completions.create(
        model=model,
        messages=ask,
        tools=TOOLS,
        max_tokens=120,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = named.choices[0].message.tool_calls
    _validated(call, SCHEMAS)
    history = ask + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 24 C"}'},
    ]
    answer = await smollm2_client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert answer.choices[0].message.content.strip()
    assert answer.choices[0].message.tool_calls is None
    await wait_until_idle(smollm2_default_server)
    assert_no_leaked_blocks(smollm2_default_server)


def _held_compile(server, monkeypatch, note: str):
    """A forced get_time call whose schema (an enum naming `note`: new to this test) compiles
    only once the returned event is set, and the event set when the compile starts."""
    schema = dict(ZONE_SCHEMA, properties=dict(ZONE_SCHEMA["properties"], note={"enum": [note]}))
    body = dict(
        model=_model(server),
        messages=ASK,
        max_tokens=60,
        seed=3,
        tools=[_tool("get_time", schema)],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    grammars = server.admission.serving.grammars
    release, started = threading.Event(), threading.Event()
    compile_now = grammars._compile

    def held(spec):
        started.set()
        release.wait(120)
        return compile_now(spec)

    monkeypatch.setattr(grammars, "_compile", held)
    return schema, body, release, started


@pytest.mark.skipif(
    bool(FRONTEND_PROCESSES),
    reason="the doors compile in frontend processes, out of the test's reach; the next test "
    "holds the compile this layout adds, the engine core's",
)
async def test_a_compile_past_its_bound_is_a_400_serves_others_meanwhile_and_is_kept(
    tiny_server, client, monkeypatch
):
    """The compile is held until the test lets it go (whatever the engine's speed), so the
    bound passes while it runs: the request gets a 400, other requests are served meanwhile
    (the compile is off the event loop), and the compile, once done, serves the next try."""
    schema, body, release, started = _held_compile(tiny_server, monkeypatch, "x7")
    grammars = tiny_server.admission.serving.grammars
    compiled = grammars.num_compiled
    config = tiny_server.admission.config
    tiny_server.admission.config = dataclasses.replace(config, max_grammar_compile_s=0.05)
    try:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(**body)
        assert started.wait(60) and grammars.num_compiled == compiled  # still compiling
        plain = await client.chat.completions.create(
            model=body["model"], messages=ASK, max_tokens=8, seed=3
        )
        assert plain.usage.completion_tokens > 0
    finally:
        tiny_server.admission.config = config
        release.set()
    assert raised.value.body["param"] == "tools"
    assert "took over 0.05 s to compile" in raised.value.body["message"]
    result = await client.chat.completions.create(**body)  # the compile went on: not redone
    assert grammars.num_compiled == compiled + 1
    _validated(result.choices[0].message.tool_calls[0], {"get_time": schema})
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


@pytest.mark.skipif(
    not FRONTEND_PROCESSES,
    reason="the engine core compiles a grammar again only behind frontend processes "
    "(PLANSERVE_TEST_FRONTEND_PROCESSES); the test before holds the doors' compile",
)
async def test_behind_frontends_a_held_compile_in_the_core_serves_others_meanwhile(
    tiny_server, client, monkeypatch
):
    """Behind frontend processes the frontend compiles within the bound, then the engine core
    compiles the grammar again for the guide it steps: that compile, held, keeps only its own
    request waiting (it is off the core's loop), and the request is served once it is done."""
    schema, body, release, started = _held_compile(tiny_server, monkeypatch, "x8")
    grammars = tiny_server.admission.serving.grammars
    compiled = grammars.num_compiled
    held = asyncio.create_task(client.chat.completions.create(**body))
    try:
        assert await asyncio.to_thread(started.wait, 60)
        plain = await client.chat.completions.create(
            model=body["model"], messages=ASK, max_tokens=8, seed=3
        )
        assert plain.usage.completion_tokens > 0
        assert not held.done() and grammars.num_compiled == compiled
    finally:
        release.set()
    result = await asyncio.wait_for(held, 120)
    assert grammars.num_compiled == compiled + 1
    _validated(result.choices[0].message.tool_calls[0], {"get_time": schema})
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_each_of_n_samples_gets_its_own_calls_streamed_with_usage(tiny_server, client):
    kwargs = dict(
        model=_model(tiny_server),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        seed=9,
        n=2,
    )
    whole = await client.chat.completions.create(**kwargs)
    assert [choice.index for choice in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        _validated(call, SCHEMAS)
    calls: dict[int, dict] = {}
    reasons: dict[int, str] = {}
    usage = None
    stream = await client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or ():
                call = calls.setdefault(choice.index, {"name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for index, choice in enumerate(whole.choices):  # same seed: the same calls
        [call] = choice.message.tool_calls
        assert calls[index]["name"] == call.function.name
        assert json.loads(calls[index]["arguments"]) == json.loads(call.function.arguments)
    assert usage.completion_tokens == whole.usage.completion_tokens
