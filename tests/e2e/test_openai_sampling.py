"""The OpenAI door's logprobs, penalties, logit_bias and min_tokens, with the official client,
against the same request over gRPC."""
from __future__ import annotations

import openai
import pytest

from api import complete, greedy_ids_request, stub_for

PROMPT_IDS = [1, 17, 300, 4000, 22, 9]


@pytest.fixture
def client(tiny_server):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1",
                              api_key="x", max_retries=0, timeout=120)


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


async def _grpc_logprobs(server, k):
    request = greedy_ids_request(PROMPT_IDS, 6, logprobs=True, top_logprobs=k)
    chunks = [c async for c in stub_for(server).Generate(request)]
    return [e for c in chunks for e in c.logprobs]


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs_match_grpc(tiny_server, client, stream):
    expected = await _grpc_logprobs(tiny_server, 2)
    kwargs = dict(model=_model(tiny_server), prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                  logprobs=2, extra_body={"ignore_eos": True})
    if stream:
        chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
        shapes = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        token_logprobs = [lp for s in shapes for lp in s.token_logprobs]
        top = [t for s in shapes for t in s.top_logprobs]
        offsets = [o for s in shapes for o in s.text_offset]
    else:
        result = await client.completions.create(**kwargs)
        logprobs = result.choices[0].logprobs
        token_logprobs, top, offsets = logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset
    assert token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-6)
    assert [len(t) for t in top] == [2] * 6 or all(1 <= len(t) <= 2 for t in top)  # equal texts merge
    assert offsets == sorted(offsets) and offsets[0] == 0


async def test_chat_logprobs_have_tokens_bytes_and_alternatives(tiny_server, client):
    result = await client.chat.completions.create(
        model=_model(tiny_server), messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0
        assert bytes(item.bytes).decode() == item.token
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)  # greedy


async def test_penalties_bias_and_min_tokens_map_onto_the_grpc_request(tiny_server, client):
    eos = min(tiny_server.loop.scheduler.facts.eos_token_ids)
    request = greedy_ids_request(PROMPT_IDS, 12)
    request.stopping.ignore_eos = False
    request.stopping.min_new_tokens = 3
    request.sampling.logit_bias[eos] = 100.0
    request.sampling.presence_penalty = 1.5
    request.sampling.frequency_penalty = 0.5
    grpc_out = await complete(stub_for(tiny_server), request)
    assert len(grpc_out.token_ids) == 4 and grpc_out.token_ids[-1] == eos
    result = await client.completions.create(
        model=_model(tiny_server), prompt=PROMPT_IDS, max_tokens=12, temperature=0,
        logit_bias={str(eos): 100}, presence_penalty=1.5, frequency_penalty=0.5,
        extra_body={"min_tokens": 3, "return_token_ids": True})
    assert result.choices[0].model_extra["token_ids"] == grpc_out.token_ids
    assert result.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs, param", [
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logprobs=21), "logprobs"),
    (dict(extra_body={"min_tokens": 99}), "min_tokens"),
])
async def test_bad_values_are_openai_errors_naming_the_param(tiny_server, client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model=_model(tiny_server), prompt=PROMPT_IDS,
                                        max_tokens=4, **kwargs)
    assert error.value.status_code == 400
    assert error.value.body["param"] == param
