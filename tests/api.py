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
