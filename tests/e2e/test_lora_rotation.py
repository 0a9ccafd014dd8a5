"""Preemptive LoRA rotation end to end (docs/lora.md): three adapters over one place on the tiny
model, with `--lora-preempt-after-steps 2`, so the running adapter is preempted (recompute)
while the others wait; every request ends with exactly the tokens it gets alone."""

from __future__ import annotations

import asyncio

import openai
import pytest_asyncio
from test_lora import adapter_root  # noqa: F401  (the module fixture: root/{a1,a2,a3})
from test_lora import greedy_tokens, one_place_server


@pytest_asyncio.fixture(scope="module")
async def rotating_server(adapter_root):  # noqa: F811
    engine, server = await one_place_server(adapter_root[0], "float32", lora_preempt_after_steps=2)
    yield server
    await server.stop(grace_s=1)
    engine.stop()


async def test_preempted_adapters_resume_with_the_tokens_they_get_alone(rotating_server):
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{rotating_server.http_port}/v1", api_key="unused"
    )
    models = ["a1", "a2", "a3"]
    alone = {model: await greedy_tokens(client, model) for model in models}
    assert len({tuple(tokens) for tokens in alone.values()}) == 3  # three different adapters
    scheduler = rotating_server.loop.scheduler
    before = scheduler.num_lora_rotations_total
    together = await asyncio.gather(*(greedy_tokens(client, m) for m in models * 2))
    assert together == [alone[m] for m in models * 2]
    assert scheduler.num_lora_rotations_total > before, "no adapter was preempted"
    assert not scheduler.loras.running and not scheduler.loras.promised
