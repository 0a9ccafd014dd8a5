"""Launch-ahead through real servers (tiny model, float32: its tokens are compared with the default
engine's, which serves float32): a model service whose steps launch behind the step
in flight (cuda_graphs "eager" and launch_ahead "on": the padded path a CUDA graph replays, each
launched step waiting on the CPU for the next plan as a GPU's forward would let it) under the
default scheduler (overlap: two plans in flight) gives the default engine's greedy tokens for
requests that join while others decode; a stop seen while the next step is launched sends nothing
past it, an abort frees every block, and a sampled request beside greedy ones keeps its seed's
tokens. The model service runs in this process so that the test can count what launched ahead."""

import asyncio
import dataclasses

import pytest_asyncio

from api import (assert_a_stop_in_flight_ends_exactly_there, assert_an_abort_in_flight_frees_every_block,
                 assert_no_leaked_blocks, complete, greedy_ids_request, staggered_greedy, stub_for,
                 wait_until_idle)
from conftest import start_scheduler
from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.server import serve, shutdown
from model_service.start import build_runner

PROMPTS = [list(range(300, 307)), list(range(1000, 1030)), list(range(2000, 2150)), [9] * 70]
CONFIG = ModelServiceConfig(model="tiny", dtype="float32", num_kv_blocks=64, port=0,
                            cuda_graphs="eager", launch_ahead="on")


@pytest_asyncio.fixture(scope="module")
async def ahead():
    """(scheduler server, model-service runner) with launch-ahead."""
    runner = build_runner(load_model(CONFIG), CONFIG)
    assert runner.compute["launch_ahead"] == "steps without penalties, masks or logprobs"
    engine = await serve(dataclasses.replace(CONFIG), runner=runner)
    server = await start_scheduler(f"127.0.0.1:{engine.bound_port}", max_num_batched_tokens=64,
                                   max_num_seqs=16)
    yield server, runner
    await server.stop(grace_s=1)
    await shutdown(engine, grace_s=0.5)


async def test_steps_launched_ahead_give_the_default_engines_tokens(ahead, tiny_server):
    server, runner = ahead
    launched = runner.ahead.launched
    assert await staggered_greedy(server, PROMPTS) == await staggered_greedy(tiny_server, PROMPTS)
    # Steps launched behind another: most of the ~40 decode steps when the machine keeps up;
    # a plan that comes after the CPU's 20 ms hold finds its step already answered.
    assert runner.ahead.launched - launched >= 5
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_a_stop_while_the_next_step_is_launched_ends_exactly_there(ahead, tiny_server):
    await assert_a_stop_in_flight_ends_exactly_there(ahead[0], tiny_server, PROMPTS[0])


async def test_an_abort_while_steps_are_launched_frees_every_block(ahead):
    await assert_an_abort_in_flight_frees_every_block(ahead[0], PROMPTS[2], "ahead-abort")


async def test_a_sampled_request_beside_launched_steps_keeps_its_seeds_tokens(ahead, tiny_server):
    server, runner = ahead

    def sampled():
        request = greedy_ids_request(PROMPTS[1], 24)
        request.sampling.temperature = 0.9
        request.sampling.seed = 11
        return request

    alone = (await complete(stub_for(tiny_server), sampled())).token_ids
    stub = stub_for(server)
    greedy = [asyncio.ensure_future(complete(stub, greedy_ids_request(p, 48))) for p in PROMPTS[2:]]
    await asyncio.sleep(0.2)
    assert (await complete(stub, sampled())).token_ids == alone
    reference = [(await complete(stub_for(tiny_server), greedy_ids_request(p, 48))).token_ids
                 for p in PROMPTS[2:]]
    assert [c.token_ids for c in await asyncio.gather(*greedy)] == reference
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)
