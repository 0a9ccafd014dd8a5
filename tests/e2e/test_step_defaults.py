"""The step shape from the model service's Describe (step_token_budget, step_max_seqs) adopted by
a real scheduler, and the scheduler's flags winning over it; a real model service on 127.0.0.1
(the tiny model on the CPU) with a non-default choice: --profile-step-tokens 96, 24 slots."""

from __future__ import annotations

import grpc
import pytest
import torch
from api import complete, greedy_ids_request, stub_for
from conftest import EngineProcess, start_scheduler

from model_service.step import kv_budget
from planserve.v1 import engine_pb2, engine_pb2_grpc
from scheduler_service.core.scheduler import Scheduler


@pytest.fixture(scope="module")
def chosen_engine():
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--profile-step-tokens", "96",
                           "--max-num-slots", "24", "--kv-cache-memory", "4MiB")
    yield engine.address
    engine.stop()


def _describe(address: str) -> engine_pb2.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        return stub.Describe(engine_pb2.DescribeRequest(), timeout=60)


def test_describe_reports_the_cpu_shape_and_a_fixed_cache(tiny_engine):
    """The shared tiny engine (CPU, 64 blocks given): the CPU's shape."""
    reply = _describe(tiny_engine)
    assert (reply.step_token_budget, reply.step_max_seqs) == (512, 64)
    assert reply.compute["kv_budget"] == "64 blocks (fixed)"


def test_describe_reports_the_chosen_step_and_the_budgets_basis(chosen_engine):
    reply = _describe(chosen_engine)
    assert (reply.step_token_budget, reply.step_max_seqs) == (96, 24)
    assert reply.compute["kv_budget"] == f"{4 << 20} bytes (kv_cache_memory_bytes)"
    per_block = kv_budget.kv_block_bytes(2, 16, 2, 16, torch.float32)
    assert reply.num_kv_blocks == (4 << 20) // per_block


def _record_plans(scheduler: Scheduler) -> list[tuple[int, int]]:
    """(tokens, sequences) of every plan the scheduler builds from now on."""
    plans: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def recording():
        plan = schedule()
        plans.append((sum(plan.num_scheduled_tokens), len(plan.slots)))
        return plan

    scheduler.schedule = recording  # type: ignore[method-assign]
    return plans


async def _serve_a_long_prompt(server) -> list[tuple[int, int]]:
    plans = _record_plans(server.loop.scheduler)
    prompt = [3 + i % 90 for i in range(300)]
    completion = await complete(stub_for(server), greedy_ids_request(prompt, 4))
    assert len(completion.token_ids) == 4
    return plans


async def test_the_scheduler_adopts_the_engines_step(chosen_engine):
    server = await start_scheduler(chosen_engine)
    try:
        scheduler = server.loop.scheduler
        assert (scheduler.token_budget, scheduler.max_num_seqs) == (96, 24)
        plans = await _serve_a_long_prompt(server)
    finally:
        await server.stop(grace_s=1)
    # 300 prompt tokens in chunks of the engine's 96.
    assert [tokens for tokens, _ in plans[:4]] == [96, 96, 96, 12]


async def test_the_schedulers_flags_win_over_the_engines_step(chosen_engine):
    server = await start_scheduler(chosen_engine, max_num_batched_tokens=40, max_num_seqs=8)
    try:
        scheduler = server.loop.scheduler
        assert (scheduler.token_budget, scheduler.max_num_seqs) == (40, 8)
        plans = await _serve_a_long_prompt(server)
    finally:
        await server.stop(grace_s=1)
    assert max(tokens for tokens, _ in plans) == 40
    # A sequence flag above the engine's slots is held to them.
    server = await start_scheduler(chosen_engine, max_num_seqs=100)
    try:
        assert (server.loop.scheduler.token_budget, server.loop.scheduler.max_num_seqs) == (96, 24)
    finally:
        await server.stop(grace_s=1)
