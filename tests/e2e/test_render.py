"""vLLM's render endpoints: the token ids a generation of the same body uses, exactly (the chat
template, a system message, special tokens), read from the requests the engine side received."""

from __future__ import annotations

import asyncio

import pytest
from api import http_json, wait_until_idle

SPECIAL = "<|im_start|>"  # SmolLM2's chat-turn token, as text inside a message


async def post(server, path: str, body: dict) -> tuple[int, object]:
    return await asyncio.to_thread(http_json, server.http_port, path, body)


@pytest.fixture
def prompts_seen(tiny_server, monkeypatch):
    """The prompt ids of every request the doors hand to the engine side (a spy on the real
    frontend: the request still goes on to be generated)."""
    frontend, seen = tiny_server.loop, []
    add_request = frontend.add_request

    def spy(request):
        seen.append(list(request.prompt_token_ids))
        return add_request(request)

    monkeypatch.setattr(frontend, "add_request", spy)
    return seen


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


CHATS = [
    [{"role": "user", "content": "Name three colours."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": f"Say {SPECIAL} back to me."},
        {"role": "assistant", "content": "No."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Why "}, {"type": "text", "text": "not?"}],
        },
    ],
]


@pytest.mark.parametrize("messages", CHATS)
async def test_chat_render_is_the_prompt_generation_uses(tiny_server, prompts_seen, messages):
    body = {"model": _model(tiny_server), "messages": messages, "max_tokens": 3}
    status, rendered = await post(tiny_server, "/v1/chat/completions/render", body)
    assert status == 200, rendered
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["features"] is None
    assert rendered["sampling_params"]["max_tokens"] == 3
    assert prompts_seen == []  # rendering queues nothing
    status, _ = await post(tiny_server, "/v1/chat/completions", body)
    assert status == 200
    assert prompts_seen == [rendered["token_ids"]]
    tokenizer = tiny_server.servicer.serving.tokenizer
    im_start = tokenizer.encode(SPECIAL, add_special_tokens=False)
    assert len(im_start) == 1  # one special token, not its characters
    assert rendered["token_ids"].count(im_start[0]) >= len(messages) + 1  # + the reply's turn
    text = tokenizer.decode(rendered["token_ids"], skip_special_tokens=False)
    assert all(m["content"] in text for m in messages if isinstance(m["content"], str))
    await wait_until_idle(tiny_server)


@pytest.mark.parametrize("prompt", ["Hello, world! " + SPECIAL + " again", [1, 17, 300, 4000]])
async def test_completion_render_is_the_prompt_generation_uses(tiny_server, prompts_seen, prompt):
    body = {"model": _model(tiny_server), "prompt": prompt, "max_tokens": 2}
    status, rendered = await post(tiny_server, "/v1/completions/render", body)
    assert status == 200, rendered
    [one] = rendered
    status, _ = await post(tiny_server, "/v1/completions", body)
    assert status == 200
    assert prompts_seen == [one["token_ids"]]
    if isinstance(prompt, list):
        assert one["token_ids"] == prompt
    await wait_until_idle(tiny_server)


async def test_render_refuses_what_generation_refuses(tiny_server):
    model = _model(tiny_server)
    status, error = await post(
        tiny_server, "/v1/completions/render", {"model": model, "prompt": "hi", "max_tokens": -1}
    )
    assert status == 400 and error["error"]["param"] == "max_tokens"
    status, error = await post(
        tiny_server,
        "/v1/chat/completions/render",
        {"model": "other", "messages": [{"role": "user", "content": "x"}]},
    )
    assert status == 404 and error["error"]["param"] == "model"
    status, error = await post(
        tiny_server, "/v1/completions/render", {"model": model, "prompt": [10**9]}
    )
    assert status == 400 and error["error"]["param"] == "prompt"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
RENDERED_BY_THE_DOOR = {  # bodies whose prompt the HTTP door renders itself (chat_prompt.py)
    "tools": {"tools": [WEATHER_TOOL], "tool_choice": "required"},
    "continue_final_message": {
        "messages": [{"role": "user", "content": "Name a colour."},
                     {"role": "assistant", "content": "My favourite colour is"}],
        "add_generation_prompt": False, "continue_final_message": True},
    "no generation prompt": {"add_generation_prompt": False},
}


@pytest.mark.parametrize("case", sorted(RENDERED_BY_THE_DOOR))
async def test_a_chat_the_door_renders_renders_as_generation_does(tiny_server, prompts_seen, case):
    body = {"model": _model(tiny_server), "messages": CHATS[0], "max_tokens": 3,
            **RENDERED_BY_THE_DOOR[case]}
    status, rendered = await post(tiny_server, "/v1/chat/completions/render", body)
    assert status == 200, rendered
    status, _ = await post(tiny_server, "/v1/chat/completions", body)
    assert status == 200
    assert prompts_seen == [rendered["token_ids"]]
    await wait_until_idle(tiny_server)
