"""Many clients at once on the tiny model: every request ends right and no block leaks."""
import asyncio

from api import assert_no_leaked_blocks, complete, greedy_ids_request, stub_for, wait_until_idle
from planserve.v1 import generate_pb2


async def test_sixteen_concurrent_generates_finish_with_usage_and_free_every_block(tiny_server):
    stub = stub_for(tiny_server)
    # Prompts of 3..93 tokens and 8..38 new tokens: with 64 KV blocks of 16 tokens the batch
    # outgrows the cache, so preemption and recompute happen along the way.
    requests = [
        greedy_ids_request([(7 * i + j) % 1000 + 1 for j in range(3 + 6 * i)], 8 + 2 * i)
        for i in range(16)
    ]
    completions = await asyncio.gather(*(complete(stub, r) for r in requests))

    for request, completion in zip(requests, completions):
        wanted = request.stopping.max_new_tokens
        assert completion.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert len(completion.token_ids) == wanted
        assert completion.usage.completion_tokens == wanted
        assert completion.usage.prompt_tokens == len(request.token_ids.ids)
        assert completion.usage.time_to_first_token_us >= completion.usage.queue_time_us
    assert len({c.request_id for c in completions}) == 16
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_greedy_output_is_the_same_alone_and_in_a_crowd(tiny_server):
    stub = stub_for(tiny_server)
    prompt = list(range(100, 140))
    alone = await complete(stub, greedy_ids_request(prompt, 24))
    crowd = await asyncio.gather(*(
        complete(stub, greedy_ids_request(prompt if i == 5 else list(range(i + 1, i + 60)), 24))
        for i in range(10)))
    assert crowd[5].token_ids == alone.token_ids
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)
