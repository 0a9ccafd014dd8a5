"""stream_interval: the server sends a chunk once that many new tokens are ready (and always the
last one), over gRPC and the OpenAI API, without changing a single token."""
from __future__ import annotations

import grpc
import openai
import pytest

from api import assert_no_leaked_blocks, complete, greedy_ids_request, stub_for, wait_until_idle

PROMPT_IDS = [1, 17, 300, 4000, 22, 9]
NUM_TOKENS = 23


async def test_chunks_hold_interval_tokens_and_the_tokens_do_not_change(tiny_server):
    stub = stub_for(tiny_server)
    every_step = await complete(stub, greedy_ids_request(PROMPT_IDS, NUM_TOKENS))
    chunks = [chunk async for chunk in stub.Generate(
        greedy_ids_request(PROMPT_IDS, NUM_TOKENS, stream_interval=5))]
    assert every_step.num_chunks >= NUM_TOKENS  # one per step without it
    sizes = [len(chunk.token_ids) for chunk in chunks]
    # Every chunk but the last holds at least 5 tokens (a step may bring several).
    assert all(size >= 5 for size in sizes[:-1]), sizes
    assert len(chunks) <= NUM_TOKENS // 5 + 1 < every_step.num_chunks
    assert [t for chunk in chunks for t in chunk.token_ids] == every_step.token_ids
    assert "".join(chunk.text for chunk in chunks) == every_step.text
    assert chunks[-1].finish_reason == every_step.finish_reason
    assert chunks[-1].usage.completion_tokens == NUM_TOKENS
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_interval_larger_than_the_output_sends_one_chunk(tiny_server):
    stub = stub_for(tiny_server)
    chunks = [chunk async for chunk in stub.Generate(
        greedy_ids_request(PROMPT_IDS, 7, stream_interval=1024))]
    assert len(chunks) == 1 and len(chunks[0].token_ids) == 7
    assert chunks[0].finish_reason and chunks[0].usage.completion_tokens == 7


async def test_parallel_samples_each_get_their_tokens(tiny_server):
    stub = stub_for(tiny_server)
    request = greedy_ids_request(PROMPT_IDS, 9, n=3, stream_interval=4)
    request.sampling.temperature = 1.0
    request.sampling.seed = 7
    chunks = [chunk async for chunk in stub.Generate(request)]
    for index in range(3):
        mine = [c for c in chunks if c.index == index]
        assert sum(len(c.token_ids) for c in mine) == 9
        assert all(len(c.token_ids) >= 4 for c in mine[:-1])
        assert mine[-1].finish_reason


@pytest.mark.parametrize("interval", [0, 1025])
async def test_out_of_range_interval_is_invalid_argument(tiny_server, interval):
    stub = stub_for(tiny_server)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await complete(stub, greedy_ids_request(PROMPT_IDS, 4, stream_interval=interval))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_interval" in error.value.details() and "1024" in error.value.details()


async def test_openai_stream_interval_extra_field(tiny_server):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1",
                                api_key="x", max_retries=0, timeout=120)
    model = tiny_server.servicer.serving.facts.model_name
    kwargs = dict(model=model, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, temperature=0,
                  stream=True)

    async def chunks(extra: dict) -> list:
        stream = await client.completions.create(
            extra_body={"ignore_eos": True, "return_token_ids": True, **extra}, **kwargs)
        return [choice async for chunk in stream for choice in chunk.choices]

    every_step = await chunks({})
    batched = await chunks({"stream_interval": 6})
    assert len(batched) < len(every_step)
    assert all(len(c.model_extra["token_ids"]) >= 6 for c in batched[:-1])
    assert ([t for c in batched for t in c.model_extra["token_ids"]]
            == [t for c in every_step for t in c.model_extra["token_ids"]])
    assert "".join(c.text for c in batched) == "".join(c.text for c in every_step)
    with pytest.raises(openai.BadRequestError) as error:
        await chunks({"stream_interval": 0})
    assert error.value.body["param"] == "stream_interval"
