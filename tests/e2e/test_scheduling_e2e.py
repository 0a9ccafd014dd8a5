"""Prefix caching, Abort and deadlines through the public API, on real servers."""
import asyncio

import grpc
import pytest

from api import assert_no_leaked_blocks, complete, greedy_ids_request, stub_for, wait_until_idle
from planserve.v1 import generate_pb2


async def test_shared_prefix_is_served_from_the_cache_with_identical_output(tiny_server):
    stub = stub_for(tiny_server)
    prefix = [(i * 37) % 5000 + 7 for i in range(100)]  # 6 full blocks of 16
    first = await complete(stub, greedy_ids_request(prefix + [11, 12], 16))
    second = await complete(stub, greedy_ids_request(prefix + [11, 12], 16))
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 96
    assert second.token_ids == first.token_ids
    salted = greedy_ids_request(prefix + [11, 12], 16, cache_salt="someone else")
    assert (await complete(stub, salted)).usage.cached_tokens == 0
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_abort_rpc_ends_the_stream_cancelled_and_frees_blocks(tiny_server):
    stub = stub_for(tiny_server)
    call = stub.Generate(greedy_ids_request(list(range(1, 40)), 400, request_id="to-abort"))
    first = await call.read()
    assert first.request_id == "to-abort"
    await stub.Abort(generate_pb2.AbortRequest(request_id="to-abort"))
    chunks = [first]
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_CANCELLED
    assert chunks[-1].usage.completion_tokens < 400
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Abort(generate_pb2.AbortRequest(request_id="to-abort"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_deadline_ends_a_long_request_with_the_tokens_it_has(tiny_server):
    stub = stub_for(tiny_server)
    request = greedy_ids_request(list(range(1, 20)), 500)
    request.deadline_ms = 300
    completion = await complete(stub, request)
    assert completion.finish_reason == generate_pb2.FINISH_REASON_DEADLINE
    assert 0 < len(completion.token_ids) < 500
    assert completion.usage.completion_tokens == len(completion.token_ids)
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_bad_scheduling_fields_are_invalid_argument(tiny_server):
    stub = stub_for(tiny_server)
    for field, value, expected in (("deadline_ms", 0, "deadline_ms: must be >= 1"),
                                   ("tenant", "t" * 129, "tenant: at most 128"),
                                   ("cache_salt", "s" * 257, "cache_salt: at most 256")):
        request = greedy_ids_request([1, 2, 3], 2)
        setattr(request, field, value)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await complete(stub, request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in raised.value.details()


async def test_parallel_samples_share_the_prompt_and_match_single_seeded_requests(tiny_server):
    stub = stub_for(tiny_server)
    prompt = [(i * 13) % 3000 + 5 for i in range(37)]  # the last token lands mid-block: a copy

    def request(n, seed):
        r = greedy_ids_request(prompt, 12, n=n)
        r.sampling.temperature = 1.0
        r.sampling.seed = seed
        return r

    chunks = [c async for c in stub.Generate(request(3, 1000))]
    by_index = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in range(3)}
    finals = [c for c in chunks if c.finish_reason]
    assert sorted(c.index for c in finals) == [0, 1, 2]
    assert all(c.finish_reason == generate_pb2.FINISH_REASON_LENGTH for c in finals)
    assert all(c.request_id == chunks[0].request_id for c in chunks)
    # Sample i draws with seed + i: the same tokens as a lone request with that seed, which
    # only holds if the forked samples saw the parent's prompt KV (shared and copied blocks).
    for index in range(3):
        alone = await complete(stub, request(1, 1000 + index))
        assert by_index[index] == alone.token_ids
    assert len({tuple(v) for v in by_index.values()}) > 1
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_n_out_of_range_is_invalid_argument(tiny_server):
    stub = stub_for(tiny_server)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await complete(stub, greedy_ids_request([1, 2, 3], 2, n=17))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n: must be in [1, 16]" in raised.value.details()
