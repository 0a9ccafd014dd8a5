"""POST /v1/messages through the official `anthropic` client against the tiny server's HTTP door:
the same request as a chat completion (same tokens at temperature 0), Anthropic's shapes and
events, tool_use under a tool's schema streamed and not, a tool_result conversation, x-api-key
as the token, and bad input as a 400 naming the field."""

from __future__ import annotations

import anthropic
import jsonschema
import openai
import pytest
from api import assert_no_leaked_blocks, wait_until_idle

from scheduler_service.api import security
from scheduler_service.api.http_server import HttpServer

ZONE = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "enum": ["CET", "UTC"]},
        "hours": {"type": "integer", "enum": [1, 2]},
    },
    "required": ["zone", "hours"],
}
TOOLS = [{"name": "get_time", "description": "The time in a zone", "input_schema": ZONE}]
ASK = [{"role": "user", "content": "What time is it in Berlin?"}]
# This client version has no sampling parameters of its own; the body's are read all the same.
GREEDY = {"extra_body": {"temperature": 0}}


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


@pytest.fixture
def client(tiny_server):
    return anthropic.AsyncAnthropic(
        base_url=f"http://127.0.0.1:{tiny_server.http_port}",
        api_key="x",
        max_retries=0,
        timeout=120,
    )


async def test_a_message_is_the_chat_completion_in_anthropics_shape(tiny_server, client):
    message = await client.messages.create(
        model=_model(tiny_server), max_tokens=12, system="Be brief.", messages=ASK, **GREEDY
    )
    chat = await openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1", api_key="x", max_retries=0
    ).chat.completions.create(
        model=_model(tiny_server),
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *ASK],
    )
    assert message.type == "message" and message.role == "assistant"
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert (
        message.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    )
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    async with client.messages.stream(
        model=_model(tiny_server), max_tokens=12, system="Be brief.", messages=ASK, **GREEDY
    ) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    assert streamed.stop_reason == message.stop_reason
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds


async def test_a_named_tool_gives_tool_use_valid_under_its_schema_streamed_or_not(
    tiny_server, client
):
    kwargs = dict(
        model=_model(tiny_server),
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_time"},
        **GREEDY,
    )
    message = await client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_time" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, ZONE)
    async with client.messages.stream(**kwargs) as stream:
        streamed = await stream.get_final_message()
    [streamed_call] = [block for block in streamed.content if block.type == "tool_use"]
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)
    assert streamed.stop_reason == "tool_use"
    # "any" is "required": at least one call, valid.
    anyone = await client.messages.create(
        **dict(kwargs, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    )
    [any_call] = [block for block in anyone.content if block.type == "tool_use"]
    jsonschema.validate(any_call.input, ZONE)


async def test_a_tool_result_conversation_goes_on(tiny_server, client):
    history = ASK + [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_time",
                    "input": {"zone": "CET", "hours": 1},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "14:05"}],
        },
    ]
    message = await client.messages.create(
        model=_model(tiny_server),
        max_tokens=8,
        messages=history,
        tools=TOOLS,
        tool_choice={"type": "none"},
        **GREEDY,
    )
    assert message.content[0].type == "text" and message.content[0].text
    shorter = await client.messages.create(
        model=_model(tiny_server),
        max_tokens=8,
        messages=history[:2],
        tools=TOOLS,
        tool_choice={"type": "none"},
        **GREEDY,
    )
    assert message.usage.input_tokens > shorter.usage.input_tokens  # the result is in the prompt


@pytest.mark.parametrize(
    "overrides,words",
    [
        (
            {"tool_choice": {"type": "sometimes"}},
            "tool_choice.type: must be auto, any, tool or none",
        ),
        ({"tool_choice": {"type": "tool", "name": "get_date"}}, "no tool named 'get_date'"),
        ({"tool_choice": {"type": "auto"}}, "--enable-auto-tool-choice"),
        ({"tools": [{"name": "f"}], "tool_choice": {"type": "none"}}, "tools[0].input_schema"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 0, "tool_choice": {"type": "none"}}, "max_tokens: must be in [1,"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(tiny_server, client, overrides, words):
    body = dict(model=_model(tiny_server), max_tokens=8, messages=ASK, tools=TOOLS)
    body.update(overrides)
    with pytest.raises(anthropic.BadRequestError) as raised:
        await client.messages.create(**body)
    assert raised.value.body["type"] == "error"
    assert words in raised.value.body["error"]["message"], raised.value.body
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_x_api_key_is_accepted_as_the_token(tiny_server):
    http = HttpServer(tiny_server.admission, "127.0.0.1", 0)
    security.add_http_bearer_auth(http.app, "s3cret")
    port = await http.start()
    try:

        def client(key):
            return anthropic.AsyncAnthropic(
                base_url=f"http://127.0.0.1:{port}", api_key=key, max_retries=0, timeout=60
            )

        message = await client("s3cret").messages.create(
            model=_model(tiny_server), max_tokens=2, messages=ASK
        )
        assert message.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError):
            await client("wrong").messages.create(
                model=_model(tiny_server), max_tokens=2, messages=ASK
            )
    finally:
        await http.stop(grace_s=1)


async def test_a_last_assistant_message_is_continued_as_a_prefill(tiny_server, client):
    """Anthropic's prefill: the reply goes on from the assistant's words and holds only what
    follows them, as a chat completion that continues its final message."""
    started = [*ASK, {"role": "assistant", "content": "It is"}]
    message = await client.messages.create(
        model=_model(tiny_server), max_tokens=8, messages=started, **GREEDY
    )
    chat = await openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1", api_key="x", max_retries=0
    ).chat.completions.create(
        model=_model(tiny_server),
        max_tokens=8,
        temperature=0,
        messages=started,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    [block] = message.content
    assert block.text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    tokenizer = tiny_server.servicer.serving.tokenizer
    closed = tokenizer.encode_chat(started)  # the assistant turn closed, a new one opened
    assert message.usage.input_tokens < len(closed)


async def test_an_empty_last_assistant_message_prefills_nothing(tiny_server, client):
    plain = await client.messages.create(
        model=_model(tiny_server), max_tokens=6, messages=ASK, **GREEDY
    )
    empty = await client.messages.create(
        model=_model(tiny_server),
        max_tokens=6,
        messages=[*ASK, {"role": "assistant", "content": ""}],
        **GREEDY,
    )
    assert [b.model_dump() for b in empty.content] == [b.model_dump() for b in plain.content]
    assert empty.usage.input_tokens == plain.usage.input_tokens
