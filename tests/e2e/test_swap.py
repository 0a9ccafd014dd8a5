"""Preemption by swap end to end: a model service with few KV blocks and host swap space, a
scheduler that must preempt, real gRPC on 127.0.0.1, the tiny model.

Six greedy requests of 40 + 64 tokens (7 blocks of 16 each) share 23 usable blocks: sequences are
swapped out and back in while the others decode. Their tokens must equal those of a model service
with room for everyone (no preemption at all), and every swap block must be free afterwards.
"""
import asyncio

import numpy as np
import pytest_asyncio

from api import complete, greedy_ids_request, stub_for
from conftest import EngineProcess, start_scheduler

NEW_TOKENS = 64
BLOCK_BYTES = 8192  # the tiny Llama's KV block in float32 (2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4)


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 49152, size=40).tolist() for _ in range(6)]


@pytest_asyncio.fixture(scope="module")
async def swap_server():
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "24",
                           "--swap-space", str(64 * BLOCK_BYTES))
    server = await start_scheduler(engine.address, max_num_batched_tokens=64, max_num_seqs=8,
                                   decode_reserve_tokens=0)
    yield server
    await server.stop(grace_s=1)
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def roomy_server():
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "256")
    server = await start_scheduler(engine.address, max_num_batched_tokens=64, max_num_seqs=8)
    yield server
    await server.stop(grace_s=1)
    engine.stop()


async def _run_all(server):
    stub = stub_for(server)
    done = await asyncio.gather(*(complete(stub, greedy_ids_request(p, NEW_TOKENS)) for p in _prompts()))
    return [c.token_ids for c in done]


async def test_swap_preemption_outputs_match_a_run_without_preemption(swap_server, roomy_server):
    scheduler = swap_server.loop.scheduler
    assert scheduler.swap.num_blocks == 64  # the engine reported its swap space
    swapped = await _run_all(swap_server)
    reference = await _run_all(roomy_server)
    assert roomy_server.loop.scheduler.num_preemptions_total == 0

    swap = scheduler.swap
    print(f"\nswap: {swap.num_swap_outs} swap-outs, {swap.num_blocks_swapped_out} blocks; "
          f"{scheduler.num_preemptions_total} preemptions")
    assert swap.num_swap_outs > 0 and swap.num_swap_ins == swap.num_swap_outs
    assert all(len(tokens) == NEW_TOKENS for tokens in swapped)
    assert swapped == reference
    assert swap.num_free == 64 and swap.num_held == 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


async def test_describe_reports_swap_space(swap_server):
    facts = swap_server.loop.scheduler.facts
    assert facts.num_swap_blocks == 64 and facts.num_kv_blocks == 24
