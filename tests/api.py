"""Helpers for tests that call the public API over real gRPC."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc

from planserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.api.client import build_request  # noqa: F401  (re-exported for tests)


@dataclasses.dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: int
    usage: generate_pb2.Usage
    last: generate_pb2.GenerateResponse
    num_chunks: int


def stub_for(server) -> generate_pb2_grpc.GenerationServiceStub:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return generate_pb2_grpc.GenerationServiceStub(channel)


async def complete(stub, request: generate_pb2.GenerateRequest) -> Completion:
    token_ids, texts, chunks = [], [], []
    async for chunk in stub.Generate(request):
        chunks.append(chunk)
        token_ids.extend(chunk.token_ids)
        texts.append(chunk.text)
    last = chunks[-1]
    return Completion(chunks[0].request_id, token_ids, "".join(texts), last.finish_reason,
                      last.usage, last, len(chunks))


def greedy_ids_request(prompt_ids: list[int], max_new_tokens: int,
                       **kwargs) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(**kwargs)
    request.token_ids.ids.extend(prompt_ids)
    request.sampling.temperature = 0.0
    request.stopping.max_new_tokens = max_new_tokens
    request.stopping.ignore_eos = True
    return request


async def wait_until_idle(server, timeout_s: float = 5.0) -> None:
    """Waits for the scheduler to hold no request (aborts are applied at the next step)."""
    scheduler = server.loop.scheduler
    deadline = asyncio.get_running_loop().time() + timeout_s
    while scheduler.requests or scheduler.has_work():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"scheduler still busy: {list(scheduler.requests)}")
        await asyncio.sleep(0.01)


def assert_no_leaked_blocks(server) -> None:
    kv = server.loop.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks, (
        f"{kv.num_usable_blocks - kv.num_free_blocks} KV blocks leaked")


# Steps in flight (overlap, launch-ahead): what a server must do when the next step is computing
# before the last one's tokens are back. Each takes a server and a reference that answers step by
# step (or, for the tokens alone, any server of the same model).

async def staggered_greedy(server, prompts: list[list[int]],
                           max_new_tokens: int = 40) -> list[list[int]]:
    """Two start together, the others join while they decode; each one's greedy tokens."""
    stub = stub_for(server)
    first = [asyncio.ensure_future(complete(stub, greedy_ids_request(p, max_new_tokens)))
             for p in prompts[:2]]
    await asyncio.sleep(0.3)
    later = [asyncio.ensure_future(complete(stub, greedy_ids_request(p, max_new_tokens)))
             for p in prompts[2:]]
    return [c.token_ids for c in await asyncio.gather(*first, *later)]


async def assert_a_stop_in_flight_ends_exactly_there(server, reference, prompt: list[int]) -> None:
    """A stop token seen while the next step is computing: nothing past it is sent, and a
    request after it still counts its tokens right; no block leaks."""
    expected = (await complete(stub_for(reference), greedy_ids_request(prompt, 20))).token_ids
    for stop_at in (0, 3, 7):
        request = greedy_ids_request(prompt, 20)
        request.stopping.stop_token_ids.append(expected[stop_at])
        result = await complete(stub_for(server), request)
        assert result.token_ids == expected[:expected.index(expected[stop_at]) + 1]
        assert result.finish_reason == generate_pb2.FINISH_REASON_STOP
    result = await complete(stub_for(server), greedy_ids_request(prompt, 5))
    assert result.token_ids == expected[:5] and result.usage.completion_tokens == 5
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def assert_an_abort_in_flight_frees_every_block(server, prompt: list[int],
                                                      request_id: str) -> None:
    """An abort after a few tokens ends the stream CANCELLED, frees every block, and the server
    still serves."""
    stub = stub_for(server)
    call = stub.Generate(greedy_ids_request(prompt, 200, request_id=request_id))
    seen = 0
    async for chunk in call:
        seen += len(chunk.token_ids)
        if seen >= 3:
            await stub.Abort(generate_pb2.AbortRequest(request_id=request_id))
            break
    chunks = [c async for c in call]
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_CANCELLED
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)
    assert len((await complete(stub, greedy_ids_request(prompt[:7], 4))).token_ids) == 4
