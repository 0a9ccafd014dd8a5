"""Launch-ahead through real servers (tiny model, float32: its tokens are compared with the default
engine's, which serves float32): a model service whose steps launch behind the step
in flight (cuda_graphs "eager" and launch_ahead "on": the padded path a CUDA graph replays, each
launched step waiting on the CPU for the next plan as a GPU's forward would let it) under the
default scheduler (overlap: two plans in flight) gives the default engine's greedy tokens for
requests that join while others decode; a stop seen while the next step is launched sends nothing
past it, an abort frees every block, a sampled request beside greedy ones keeps its seed's
tokens, requests with logprobs, under a grammar or with penalties get the default engine's
tokens, logprobs and text, and parallel samples fork (a block copy) in a launched step. The model service runs in this process so that the test can count
what launched ahead."""

import asyncio
import dataclasses
import re

import pytest_asyncio

from api import (assert_a_stop_in_flight_ends_exactly_there, assert_an_abort_in_flight_frees_every_block,
                 assert_no_leaked_blocks, complete, greedy_ids_request, staggered_greedy, stub_for,
                 wait_until_idle)
from conftest import start_scheduler
from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.server import serve, shutdown
from model_service.start import build_runner
from model_service.step import launch_ahead
from planserve.v1 import common_pb2

PROMPTS = [list(range(300, 307)), list(range(1000, 1030)), list(range(2000, 2150)), [9] * 70]
CONFIG = ModelServiceConfig(model="tiny", dtype="float32", num_kv_blocks=64, port=0,
                            cuda_graphs="eager", launch_ahead="on")


@pytest_asyncio.fixture(scope="module")
async def ahead():
    """(scheduler server, model-service runner) with launch-ahead."""
    runner = build_runner(load_model(CONFIG), CONFIG)
    assert runner.compute["launch_ahead"] == launch_ahead.DESCRIBED
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


async def _tokens_and_logprobs(stub, request) -> tuple[list[int], list[tuple], str]:
    ids, logprobs, text = [], [], []
    async for chunk in stub.Generate(request):
        ids.extend(chunk.token_ids)
        text.append(chunk.text)
        logprobs.extend(
            (e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in chunk.logprobs
        )
    return ids, logprobs, "".join(text)


async def test_logprobs_a_grammar_and_penalties_beside_launched_steps_give_the_default_engines(
    ahead, tiny_server
):
    """Their steps launch too (the logprobs come back with the ids, the mask is the plan's, the
    penalties count the token in flight on the device): the tokens, the logprobs with their
    alternatives, and the constrained text are exact."""
    server, runner = ahead
    email = r"[a-z]{3,12}@[a-z]{3,8}\.(com|org)"

    def special():
        scored = greedy_ids_request(PROMPTS[1], 24, logprobs=True, top_logprobs=3)
        constrained = greedy_ids_request(
            PROMPTS[3], 40, structured_output=common_pb2.StructuredOutput(regex=email)
        )
        constrained.stopping.ignore_eos = False  # the grammar ends the output
        penalized = greedy_ids_request(PROMPTS[0], 24)
        penalized.sampling.repetition_penalty = 1.2
        penalized.sampling.frequency_penalty = 1.5
        penalized.sampling.presence_penalty = 0.5
        penalized.sampling.logit_bias[17] = 4.0
        return [scored, constrained, penalized]

    alone = [await _tokens_and_logprobs(stub_for(tiny_server), r) for r in special()]
    assert len(alone[0][1]) == 24 and all(len(top) == 3 for _, _, top in alone[0][1])
    assert re.fullmatch(email, alone[1][2]), alone[1][2]
    stub = stub_for(server)
    launched = runner.ahead.launched
    greedy = [asyncio.ensure_future(complete(stub, greedy_ids_request(p, 48))) for p in PROMPTS[:3]]
    await asyncio.sleep(0.2)
    assert await asyncio.gather(*(_tokens_and_logprobs(stub, r) for r in special())) == alone
    await asyncio.gather(*greedy)
    assert runner.ahead.launched > launched
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def _samples(stub, request) -> dict[int, list[int]]:
    by_index: dict[int, list[int]] = {}
    async for chunk in stub.Generate(request):
        by_index.setdefault(chunk.index, []).extend(chunk.token_ids)
    return by_index


async def test_parallel_samples_fork_with_a_block_copy_launched_ahead(ahead, tiny_server, monkeypatch):
    """n = 3 samples fork from the first once its prompt is computed; the prompt's last block,
    partly written, is copied for each (30 tokens: not a multiple of the block size). The plan
    carrying those copies launches behind the step in flight, and every sample's tokens are the
    default engine's."""
    server, runner = ahead

    def forked():
        request = greedy_ids_request(PROMPTS[1], 16, n=3)
        request.sampling.temperature = 0.9
        request.sampling.seed = 7
        return request

    alone = await _samples(stub_for(tiny_server), forked())
    assert sorted(alone) == [0, 1, 2] and len(set(map(tuple, alone.values()))) > 1
    copied_ahead = []
    launch = runner.ahead.launch

    def counting(plan, prior, greedy, lora=None):
        launched = launch(plan, prior, greedy, lora)
        if plan.copy_src.size and prior is not None and launched is not None:
            copied_ahead.append(plan.step_id)
        return launched

    monkeypatch.setattr(runner.ahead, "launch", counting)
    stub = stub_for(server)
    greedy = [asyncio.ensure_future(complete(stub, greedy_ids_request(p, 48))) for p in PROMPTS[2:]]
    await asyncio.sleep(0.2)
    assert await _samples(stub, forked()) == alone
    await asyncio.gather(*greedy)
    assert copied_ahead  # the fork's copies rode a step launched behind another
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)
