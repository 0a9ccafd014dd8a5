"""Tools and reasoning output on the gRPC contract (GenerateRequest.tools, tool_choice,
parallel_tool_calls, ChatMessage.tool_calls/tool_call_id, GenerateResponse.reasoning and
tool_calls), through the generated client against real servers on 127.0.0.1: the same calls as
the HTTP door for the same request, on Generate and Session, and the same refusals (naming the
GenerateRequest's field) with nothing left behind."""

from __future__ import annotations

import dataclasses
import json
import re

import grpc
import jsonschema
import openai
import pytest
from api import assert_no_leaked_blocks, stub_for, wait_until_idle

from planserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from scheduler_service.api.grpc_servicer import GenerationServicer

ZONE_SCHEMA = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "enum": ["CET", "UTC", "PST"]},
        "hours": {"type": "integer", "enum": [1, 2, 24]},
        "dst": {"type": "boolean"},
    },
    "required": ["zone", "hours", "dst"],
}
DAYS_SCHEMA = {
    "type": "object",
    "properties": {"days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2}},
    "required": ["days"],
}
SCHEMAS = {"get_time": ZONE_SCHEMA, "get_days": DAYS_SCHEMA}
ASK = "What time is it in Berlin?"
HERMES_CALL = (  # a whole output in the hermes format, forced with a regex
    r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(CET|UTC)", '
    r'"hours": 1, "dst": (true|false)\}\}\n</tool_call>'
)
MODES = generate_pb2.ToolChoiceMode


def _tools() -> list[generate_pb2.Tool]:
    return [
        generate_pb2.Tool(name=name, description=f"{name} tool", parameters=json.dumps(schema))
        for name, schema in SCHEMAS.items()
    ]


def _request(choice: generate_pb2.ToolChoice | None, max_new_tokens=80, seed=5, **kwargs):
    request = generate_pb2.GenerateRequest(tools=_tools(), **kwargs)
    if choice is not None:
        request.tool_choice.CopyFrom(choice)
    if not request.HasField("messages"):
        request.messages.messages.add(role="user", content=ASK)
    request.sampling.temperature = 1.0
    request.sampling.seed = seed
    request.stopping.max_new_tokens = max_new_tokens
    return request


def _openai_body(request: generate_pb2.GenerateRequest, choice) -> dict:
    """The same request as an OpenAI chat body."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": json.loads(t.parameters),
            },
        }
        for t in request.tools
    ]
    messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    return dict(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        seed=request.sampling.seed,
        max_tokens=request.stopping.max_new_tokens,
    )


async def _chunks(stub, request) -> list[generate_pb2.GenerateResponse]:
    return [chunk async for chunk in stub.Generate(request)]


def _calls(chunks) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for chunk in chunks for c in chunk.tool_calls]


async def _door(server, **tool_settings):
    """A second gRPC door over the server's admission, with other tool settings."""
    config = dataclasses.replace(server.config, **tool_settings)
    door = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServiceServicer_to_server(
        GenerationServicer(server.admission, config=config), door
    )
    port = door.add_insecure_port("127.0.0.1:0")
    await door.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return door, generate_pb2_grpc.GenerationServiceStub(channel)


async def test_required_gives_the_http_doors_valid_calls_on_the_last_chunk(tiny_server):
    stub = stub_for(tiny_server)
    required = generate_pb2.ToolChoice(mode=MODES.TOOL_CHOICE_MODE_REQUIRED)
    request = _request(required, parallel_tool_calls=False)
    chunks = await _chunks(stub, request)
    assert all(not chunk.tool_calls for chunk in chunks[:-1])
    [(name, arguments)] = _calls(chunks)
    jsonschema.validate(arguments, SCHEMAS[name])
    assert "".join(chunk.text for chunk in chunks) == ""  # the call is not content
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_EOS
    assert chunks[-1].tool_calls[0].id.startswith("call_")
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
    )
    body = _openai_body(request, "required")
    http = await client.chat.completions.create(
        model=tiny_server.servicer.serving.facts.model_name, parallel_tool_calls=False, **body
    )
    [call] = http.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (name, arguments)
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_a_named_function_on_generate_and_session_gives_one_valid_call(tiny_server):
    stub = stub_for(tiny_server)
    named = generate_pb2.ToolChoice(function="get_days")
    for seed in range(3):
        request = _request(named, seed=seed, n=2)
        chunks = await _chunks(stub, request)
        by_sample = {i: _calls(c for c in chunks if c.index == i) for i in range(2)}
        for calls in by_sample.values():
            [(name, arguments)] = calls
            assert name == "get_days"
            jsonschema.validate(arguments, DAYS_SCHEMA)
        session = generate_pb2.SessionRequest(generate=request)
        session.generate.request_id = f"tools-{seed}"
        replies = [reply async for reply in stub.Session(iter([session]))]
        assert _calls(r.chunk for r in replies if r.chunk.index == 0) == by_sample[0]


async def test_a_call_cut_by_max_new_tokens_is_text(tiny_server):
    request = _request(generate_pb2.ToolChoice(function="get_time"), max_new_tokens=6)
    chunks = await _chunks(stub_for(tiny_server), request)
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert _calls(chunks) == []
    assert "".join(chunk.text for chunk in chunks).startswith("{")


async def test_a_history_with_a_call_and_its_result_renders_as_on_http(tiny_server):
    request = _request(generate_pb2.ToolChoice(mode=MODES.TOOL_CHOICE_MODE_NONE), seed=0)
    request.sampling.temperature = 0.0
    request.stopping.max_new_tokens = 8
    assistant = request.messages.messages.add(role="assistant")
    assistant.tool_calls.add(id="call_1", name="get_time", arguments='{"zone": "CET"}')
    request.messages.messages.add(role="tool", content="12:00", tool_call_id="call_1")
    chunks = await _chunks(stub_for(tiny_server), request)
    assert _calls(chunks) == []
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
    )
    body = _openai_body(request, "none")
    body["messages"][1:] = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
                }
            ],
        },
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
    ]
    http = await client.chat.completions.create(
        model=tiny_server.servicer.serving.facts.model_name, temperature=0, **body
    )
    usage = chunks[-1].usage
    assert usage.prompt_tokens == http.usage.prompt_tokens  # the same prompt
    assert "".join(chunk.text for chunk in chunks) == http.choices[0].message.content


async def test_auto_reads_the_models_calls_with_the_servers_parser(tiny_server):
    door, stub = await _door(tiny_server, enable_auto_tool_choice=True, tool_call_parser="hermes")
    try:
        request = _request(None, structured_output=common_pb2.StructuredOutput(regex=HERMES_CALL))
        chunks = await _chunks(stub, request)
        assert "".join(chunk.text for chunk in chunks) == "Sure.\n"
        [(name, arguments)] = _calls(chunks)
        assert name == "get_time" and arguments["hours"] == 1
    finally:
        await door.stop(1)


async def test_reasoning_streams_apart_and_the_calls_grammar_applies_after_it(tiny_server):
    """qwen3: logit_bias on the pieces of its markers makes the tiny model open a think block
    and close it at some point; the named tool's grammar binds only what follows."""
    tokenizer = tiny_server.servicer.serving.tokenizer
    pieces = {i for m in ("<think>", "</think>") for i in tokenizer.encode(m, False)}
    door, stub = await _door(tiny_server, reasoning_parser="qwen3")
    try:
        request = _request(generate_pb2.ToolChoice(function="get_time"), max_new_tokens=400)
        for token_id in pieces:
            request.sampling.logit_bias[token_id] = 100
        chunks = await _chunks(stub, request)
        reasoning = "".join(chunk.reasoning for chunk in chunks)
        assert re.fullmatch(r"(<|</|think|>)+", reasoning) and "</think>" not in reasoning
        assert sum(bool(chunk.reasoning) for chunk in chunks) > 1  # streamed as it comes
        assert "".join(chunk.text for chunk in chunks) == ""
        [(name, arguments)] = _calls(chunks)
        assert name == "get_time"
        jsonschema.validate(arguments, ZONE_SCHEMA)
    finally:
        await door.stop(1)
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


def _bad(**change) -> generate_pb2.GenerateRequest:
    request = _request(generate_pb2.ToolChoice(mode=MODES.TOOL_CHOICE_MODE_REQUIRED))
    for field, value in change.items():
        if field == "text":
            request.text = value
        elif value is None:
            request.ClearField(field)
        elif field in ("tools", "tool_choice"):
            request.ClearField(field)
            getattr(request, field).extend(value) if field == "tools" else (
                request.tool_choice.CopyFrom(value)
            )
        else:
            getattr(request, field).CopyFrom(value)
    return request


_BAD_CALL = generate_pb2.ChatMessages()
_BAD_CALL.messages.add(role="user", content=ASK)
_BAD_CALL.messages.add(role="assistant").tool_calls.add(id="c", name="get_time", arguments="{x")
BAD = [
    (dict(tool_choice=generate_pb2.ToolChoice(function="nope")), "tool_choice.function: no tool"),
    (
        dict(tool_choice=generate_pb2.ToolChoice(mode=MODES.TOOL_CHOICE_MODE_AUTO)),
        'tool_choice: "auto" needs the server started with --enable-auto-tool-choice',
    ),
    (dict(tools=[generate_pb2.Tool(name="f", parameters="{oops")]), "tools[0].parameters: not"),
    (
        dict(tools=[generate_pb2.Tool(name="f", parameters="[1]")]),
        "tools[0].parameters: must be a JSON schema object",
    ),
    (dict(tools=[generate_pb2.Tool(name="bad name")]), "tools[0].name: must be 1 to 64"),
    (dict(tools=[generate_pb2.Tool(name=f"f{i}") for i in range(129)]), "tools: at most 128"),
    (
        dict(
            tools=[
                generate_pb2.Tool(
                    name="f",
                    parameters=json.dumps(
                        {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
                    ),
                )
            ]
        ),
        "tools: (structured_output.json_schema) cannot be compiled",
    ),
    (
        dict(structured_output=common_pb2.StructuredOutput(regex="a")),
        "structured_output: cannot be combined with tool_choice 'required'",
    ),
    (dict(tools=None), "tool_choice: needs tools"),
    (dict(text="hello"), "tools: need a messages prompt"),
    (dict(messages=_BAD_CALL), "messages.messages[1].tool_calls[0].arguments: not valid JSON"),
]


@pytest.mark.parametrize("change,words", BAD)
async def test_bad_tools_are_invalid_argument_naming_the_field(tiny_server, change, words):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await _chunks(stub_for(tiny_server), _bad(**change))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(words), raised.value.details()
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)
