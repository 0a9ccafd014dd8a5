"""POST /v1/responses through the official `openai` client against the tiny server's HTTP door:
the same request as a chat completion (same tokens at temperature 0), text and item input,
function calls under a tool's schema streamed and not, earlier outputs given back as input, and
stored state refused with a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from api import assert_no_leaked_blocks, wait_until_idle

ZONE = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "enum": ["CET", "UTC"]},
        "hours": {"type": "integer", "enum": [1, 2]},
    },
    "required": ["zone", "hours"],
}
TOOLS = [{"type": "function", "name": "get_time", "description": "The time", "parameters": ZONE}]


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


@pytest.fixture
def client(tiny_server):
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
    )


async def _streamed(client, **kwargs) -> tuple[list[str], str, dict]:
    """(event types, text from output_text deltas, the completed response)."""
    kinds, text, completed = [], [], None
    async for event in await client.responses.create(stream=True, **kwargs):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text.append(event.delta)
        if event.type == "response.completed":
            completed = event.response
    return kinds, "".join(text), completed


async def test_a_response_is_the_chat_completion_streamed_or_not(tiny_server, client):
    kwargs = dict(
        model=_model(tiny_server),
        instructions="Be brief.",
        input="Hello there",
        max_output_tokens=10,
        temperature=0,
    )
    response = await client.responses.create(**kwargs)
    chat = await client.chat.completions.create(
        model=_model(tiny_server),
        max_tokens=10,
        temperature=0,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
        ],
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    kinds, text, completed = await _streamed(client, **kwargs)
    assert text == response.output_text and completed.output_text == response.output_text
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    # Items in: the same conversation as input items gives the same text.
    as_items = await client.responses.create(
        model=_model(tiny_server),
        max_output_tokens=10,
        temperature=0,
        input=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]},
        ],
    )
    assert as_items.output_text == response.output_text


async def test_function_calls_are_valid_streamed_or_not_and_their_output_goes_back_in(
    tiny_server, client
):
    kwargs = dict(
        model=_model(tiny_server),
        input="Time in Berlin?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=60,
        temperature=0,
    )
    response = await client.responses.create(**kwargs)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), ZONE)
    kinds, _, completed = await _streamed(client, **kwargs)
    assert "response.function_call_arguments.delta" in kinds
    [streamed] = [item for item in completed.output if item.type == "function_call"]
    assert (streamed.name, json.loads(streamed.arguments)) == (
        call.name,
        json.loads(call.arguments),
    )
    follow_up = await client.responses.create(
        model=_model(tiny_server),
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=6,
        temperature=0,
        input=[
            {"role": "user", "content": "Time in Berlin?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "14:05"},
        ],
    )
    assert follow_up.output_text
    required = await client.responses.create(
        **dict(kwargs, tool_choice="required", parallel_tool_calls=False)
    )
    [any_call] = [item for item in required.output if item.type == "function_call"]
    jsonschema.validate(json.loads(any_call.arguments), ZONE)


@pytest.mark.parametrize(
    "overrides,param,words",
    [
        ({"store": True}, "store", "stored responses are not kept"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not kept"),
        (
            {"tools": [{"type": "web_search"}], "tool_choice": "none"},
            "tools",
            "only function tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "no tool named 'nope'",
        ),
        ({"input": [{"type": "image_generation_call"}]}, "input", "not supported"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(tiny_server, client, overrides, param, words):
    body = dict(model=_model(tiny_server), input="Hi", max_output_tokens=4)
    body.update(overrides)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.responses.create(**body)
    assert raised.value.body["param"] == param and words in raised.value.body["message"]
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)
