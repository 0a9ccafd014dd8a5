"""Parking end to end (docs/lora.md, core/lora_parking.py): more adapters in use than
--max-loras places, through real gRPC servers; running sequences out of turn sit steps out,
keeping their slots and KV, and every stream still gets exactly its tokens, with nothing
preempted. On the null model (six adapters over two places, many streams at once) and on the
tiny model with real adapters (three over one place, greedy tokens equal to each request's
tokens alone, in float32 and in the CPU's default dtype)."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest_asyncio
from conftest import EngineProcess, start_scheduler
from test_lora import adapter_root  # noqa: F401  (the module fixture: root/{a1,a2,a3})
from test_lora import greedy_tokens, one_place_server

from planserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

NULL_NAMES = [f"n{i}" for i in range(6)]


@pytest_asyncio.fixture(scope="module")
async def null_server(adapter_root):  # noqa: F811
    root, _ = adapter_root
    engine = EngineProcess(
        "--model", "null", "--null-step-delay-ms", "2",
        "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "6",
    )  # fmt: skip
    # The null model checks each folder and keeps no weights: names may share a folder.
    modules = tuple(
        f"{name}={root / ('a1', 'a2', 'a3')[i % 3]}" for i, name in enumerate(NULL_NAMES)
    )
    server = await start_scheduler(
        engine.address, max_num_seqs=16, lora_modules=modules, lora_park_after_steps=1
    )
    yield server
    await server.stop(grace_s=1)
    engine.stop()


async def _generate(stub, index: int, adapter: str) -> list[int]:
    request = generate_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[(index * 7 + i) % 90 + 5 for i in range(5 + index % 9)]),
        lora_name=adapter,
        stopping=generate_pb2.StoppingCriteria(max_new_tokens=12 + index % 7, ignore_eos=True),
    )
    tokens: list[int] = []
    async for chunk in stub.Generate(request):
        tokens.extend(chunk.token_ids)
    return tokens


async def test_every_stream_gets_exactly_its_tokens_with_parking(null_server):
    scheduler = null_server.loop.scheduler
    jobs = [(i, NULL_NAMES[i % len(NULL_NAMES)]) for i in range(36)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{null_server.port}") as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        alone = [await _generate(stub, i, name) for i, name in jobs[:: len(NULL_NAMES) + 1]]
        parked_before = scheduler.loras.turns.num_parked_total
        preempted_before = scheduler.num_preemptions_total
        together = await asyncio.gather(*(_generate(stub, i, name) for i, name in jobs))
    assert scheduler.loras.turns.num_parked_total > parked_before, "nothing was parked"
    assert scheduler.num_preemptions_total == preempted_before
    for (index, _), tokens in zip(jobs, together):
        assert len(tokens) == 12 + index % 7, index
    assert together[:: len(NULL_NAMES) + 1] == alone
    assert (
        not scheduler.loras.running
        and scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    )


@pytest_asyncio.fixture(scope="module", params=["float32", "auto"])
async def tiny_parking_server(request, adapter_root):  # noqa: F811
    engine, server = await one_place_server(adapter_root[0], request.param, lora_park_after_steps=1)
    yield server
    await server.stop(grace_s=1)
    engine.stop()


async def test_parked_adapters_resume_with_the_tokens_they_get_alone(tiny_parking_server):
    server = tiny_parking_server
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused"
    )
    models = ["a1", "a2", "a3"]
    alone = {model: await greedy_tokens(client, model) for model in models}
    assert len({tuple(tokens) for tokens in alone.values()}) == 3  # three different adapters
    scheduler = server.loop.scheduler
    parked_before = scheduler.loras.turns.num_parked_total
    preempted_before = scheduler.num_preemptions_total
    together = await asyncio.gather(*(greedy_tokens(client, m) for m in models * 2))
    assert together == [alone[m] for m in models * 2]
    assert scheduler.loras.turns.num_parked_total > parked_before, "nothing was parked"
    assert scheduler.num_preemptions_total == preempted_before
    assert not scheduler.loras.running
