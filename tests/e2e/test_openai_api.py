"""The OpenAI-compatible HTTP API, through the official `openai` client, against the tiny
server's HTTP door (tests/conftest.py starts it on a free port): the same engine as gRPC, the
same bounds, OpenAI's shapes."""
from __future__ import annotations

import asyncio
import types

import grpc
import openai
import pytest

from api import (assert_no_leaked_blocks, complete, greedy_ids_request, http_json, stub_for,
                 wait_until_idle)
from planserve.v1 import generate_pb2
from scheduler_service.api.http_server import HttpServer
from scheduler_service.api.admission import Rejected
from scheduler_service.config import SchedulerConfig

PROMPT_IDS = [1, 17, 300, 4000, 22, 9]


@pytest.fixture
def client(tiny_server):
    assert tiny_server.http_port, "tiny_server has no HTTP port"
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1",
                              api_key="x", max_retries=0, timeout=120)


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


async def test_models_lists_the_served_model_and_health_is_ok(tiny_server, client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [_model(tiny_server)]
    status, body = await asyncio.to_thread(http_json, tiny_server.http_port, "/health")
    assert (status, body) == (200, {"status": "ok"})


async def test_completion_greedy_matches_grpc_generate(tiny_server, client):
    grpc_out = await complete(stub_for(tiny_server), greedy_ids_request(PROMPT_IDS, 12))
    result = await client.completions.create(
        model=_model(tiny_server), prompt=PROMPT_IDS, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert result.object == "text_completion"
    [choice] = result.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.text == grpc_out.text
    assert choice.model_extra["token_ids"] == grpc_out.token_ids
    assert result.usage.prompt_tokens == len(PROMPT_IDS)
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == len(PROMPT_IDS) + 12


async def test_streamed_completion_equals_the_unstreamed_one_and_reports_usage(
        tiny_server, client):
    kwargs = dict(model=_model(tiny_server), prompt="Hello there", max_tokens=10,
                  temperature=0, extra_body={"ignore_eos": True})
    whole = await client.completions.create(**kwargs)
    stream = await client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs)
    texts, reasons, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        for choice in chunk.choices:
            texts.append(choice.text)
            reasons.append(choice.finish_reason)
    assert "".join(texts) == whole.choices[0].text
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert usage is not None and usage.completion_tokens == 10
    assert usage.prompt_tokens == whole.usage.prompt_tokens


async def test_chat_completion_matches_grpc_messages_streamed_and_not(tiny_server, client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name three colours."}]
    request = generate_pb2.GenerateRequest(
        messages=generate_pb2.ChatMessages(messages=[
            generate_pb2.ChatMessage(**m) for m in messages]),
        sampling={"temperature": 0.0}, stopping={"max_new_tokens": 8, "ignore_eos": True})
    grpc_out = await complete(stub_for(tiny_server), request)
    kwargs = dict(model=_model(tiny_server), messages=messages, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    result = await client.chat.completions.create(**kwargs)
    assert result.object == "chat.completion"
    [choice] = result.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == grpc_out.text
    assert choice.finish_reason == "length"
    assert result.usage.completion_tokens == 8

    stream = await client.chat.completions.create(stream=True, **kwargs)
    roles, contents, reasons = [], [], []
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            roles.append(c.delta.role)
            contents.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert roles[0] == "assistant"
    assert "".join(contents) == grpc_out.text
    assert reasons[-1] == "length"


async def test_n_2_gives_two_choices_with_their_indices(tiny_server, client):
    result = await client.completions.create(
        model=_model(tiny_server), prompt="Once upon", max_tokens=5, n=2, seed=7,
        temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in result.choices)
    assert result.usage.completion_tokens == 10

    stream = await client.chat.completions.create(
        model=_model(tiny_server), messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        n=2, seed=7, stream=True, extra_body={"ignore_eos": True})
    finished = set()
    async for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1}


async def test_stop_string_and_seeded_sampling_reproduce(tiny_server, client):
    kwargs = dict(model=_model(tiny_server), prompt="Hello", max_tokens=8, temperature=0.9,
                  top_p=0.95, seed=1234, extra_body={"ignore_eos": True, "top_k": 50})
    first = await client.completions.create(**kwargs)
    second = await client.completions.create(**kwargs)
    assert first.choices[0].text == second.choices[0].text
    text = first.choices[0].text
    if len(text) >= 3:  # a stop string from the middle of that text cuts it there
        stop = text[1:3]
        cut = await client.completions.create(stop=stop, **kwargs)
        assert cut.choices[0].finish_reason == "stop"
        assert stop not in cut.choices[0].text


async def test_bad_request_names_the_field_in_openai_error_shape(tiny_server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=_model(tiny_server), prompt="Hi", max_tokens=0)
    error = caught.value
    assert error.status_code == 400
    assert error.param == "max_tokens"
    assert error.body["param"] == "max_tokens"
    assert error.body["type"] == "invalid_request_error"
    assert error.body["message"].startswith("max_tokens: must be in [1, ")

    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=_model(tiny_server), messages=[{"role": "user", "content": "Hi"}],
            temperature=-1)
    assert caught.value.param == "temperature"

    with pytest.raises(openai.BadRequestError) as caught:  # a type error, caught by pydantic
        await client.completions.create(model=_model(tiny_server), prompt="Hi",
                                        extra_body={"max_tokens": "lots"})
    assert caught.value.param == "max_tokens"


async def test_unknown_model_is_not_found(tiny_server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="gpt-nothing", prompt="Hi", max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"


@pytest.fixture
def aborts(tiny_server, monkeypatch):
    """Request ids the engine loop was asked to abort during the test."""
    loop = tiny_server.loop
    aborted, abort = [], loop.abort_request

    def recording(request_id):
        aborted.append(request_id)
        return abort(request_id)

    monkeypatch.setattr(loop, "abort_request", recording)
    return aborted


async def test_a_client_that_disconnects_mid_stream_aborts_its_request(
        tiny_server, client, aborts):
    stream = await client.completions.create(
        model=_model(tiny_server), prompt="Hello", max_tokens=500, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        request_id = chunk.id.removeprefix("cmpl-")
        break
    await stream.close()
    await wait_until_idle(tiny_server, timeout_s=30)
    assert aborts == [request_id]
    assert_no_leaked_blocks(tiny_server)


async def test_a_client_that_gives_up_on_a_whole_completion_aborts_it(tiny_server, aborts):
    impatient = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1",
                                   api_key="x", max_retries=0, timeout=0.2)
    with pytest.raises(openai.APITimeoutError):
        await impatient.chat.completions.create(
            model=_model(tiny_server), messages=[{"role": "user", "content": "Hi"}],
            max_tokens=480, temperature=0, extra_body={"ignore_eos": True})
    await wait_until_idle(tiny_server, timeout_s=30)
    assert len(aborts) == 1
    assert_no_leaked_blocks(tiny_server)


class _FakeAdmission:
    """Serving state without an engine: `admit` answers what the test sets."""

    def __init__(self, serving, rejection=None):
        self.serving = serving
        self._rejection = rejection
        self.config = SchedulerConfig()  # the door reads its tool and gateway settings from it

    async def admit(self, pb, reasoning_parser=""):
        raise self._rejection


async def _fake_door(admission):
    server = HttpServer(admission, "127.0.0.1", 0)
    port = await server.start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                max_retries=0, timeout=30)
    return server, client


async def test_not_ready_is_503_and_a_full_queue_is_429():
    server, client = await _fake_door(_FakeAdmission(serving=None))
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.completions.create(model="m", prompt="Hi")
        assert caught.value.status_code == 503
        assert caught.value.body["type"] == "service_unavailable"
        status, body = await asyncio.to_thread(http_json, server.port, "/health")
        assert (status, body) == (503, {"status": "starting"})
    finally:
        await server.stop(grace_s=1)

    serving = types.SimpleNamespace(facts=types.SimpleNamespace(model_name="m",
                                                                 max_model_len=64))
    full = Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: 3 requests waiting",
                    retry_after_ms=1500)
    server, client = await _fake_door(_FakeAdmission(serving, full))
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(model="m", prompt="Hi")
        assert caught.value.status_code == 429
        assert caught.value.body["message"].startswith("queue full")
        assert caught.value.response.headers["retry-after"] == "2"  # 1.5 s, rounded up
    finally:
        await server.stop(grace_s=1)


def test_http_port_is_off_in_the_library_on_8000_in_the_cli_and_validated():
    from tools.cli import build_parser
    from scheduler_service.config import SchedulerConfig
    assert SchedulerConfig().http_port == -1
    for command in ("serve", "scheduler"):
        assert build_parser().parse_args([command]).http_port == 8000
    assert build_parser().parse_args(["scheduler", "--http-port", "0"]).http_port == 0
    with pytest.raises(ValueError, match="http_port"):
        SchedulerConfig(http_port=-2).validate()
    with pytest.raises(ValueError, match="http_port"):
        SchedulerConfig(http_port=70000).validate()
