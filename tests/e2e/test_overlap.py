"""Overlap on real servers (tiny model): the default scheduler keeps two plans in flight; its
greedy tokens equal those of a lockstep scheduler (overlap off) on its own model service, a
stop seen while the next step is already computing sends nothing past it, and an abort while
plans are in flight frees every block. A grammar-constrained request beside plain ones leaves
two plans in flight and still matches its grammar, with lockstep's tokens."""
import asyncio
import re

import grpc
import pytest
import pytest_asyncio

from api import (assert_a_stop_in_flight_ends_exactly_there, assert_an_abort_in_flight_frees_every_block,
                 assert_no_leaked_blocks, complete, greedy_ids_request, staggered_greedy, stub_for,
                 wait_until_idle)
from conftest import EngineProcess, start_scheduler
from planserve.v1 import generate_pb2

PROMPTS = [list(range(300, 307)), list(range(1000, 1030)), list(range(2000, 2150)), [9] * 70]


@pytest.fixture(scope="module")
def lockstep_engine():
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def lockstep_server(lockstep_engine):
    server = await start_scheduler(lockstep_engine, max_num_batched_tokens=64, max_num_seqs=16,
                                   overlap=False)
    yield server
    await server.stop(grace_s=1)


async def test_overlap_on_and_off_give_the_same_greedy_tokens(tiny_server, lockstep_server):
    assert tiny_server.config.overlap and not lockstep_server.config.overlap
    overlapped = await staggered_greedy(tiny_server, PROMPTS)
    lockstep = await staggered_greedy(lockstep_server, PROMPTS)
    assert overlapped == lockstep
    assert tiny_server.loop.max_in_flight_seen == 2
    assert lockstep_server.loop.max_in_flight_seen == 0


async def test_a_stop_while_the_next_step_is_in_flight_ends_exactly_there(tiny_server, lockstep_server):
    await assert_a_stop_in_flight_ends_exactly_there(tiny_server, lockstep_server, PROMPTS[0])


async def test_abort_while_plans_are_in_flight_frees_every_block(tiny_server):
    await assert_an_abort_in_flight_frees_every_block(tiny_server, PROMPTS[2], "overlap-abort")


def _constrained_request(regex: str, seed: int, request_id: str = "") -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(request_id=request_id)
    request.token_ids.ids.extend(PROMPTS[1])
    request.sampling.temperature = 1.0
    request.sampling.seed = seed
    request.stopping.max_new_tokens = 200
    request.structured_output.regex = regex
    return request


# At least 24 tokens whichever way the model splits the words: it outlasts a few plans.
LONG_REGEX = r"((red|green|blue) ){24,30}(stop|end)\."


async def test_a_constrained_request_keeps_two_plans_in_flight_and_its_grammar(
        tiny_server, lockstep_server):
    """While a grammar-constrained request runs beside plain ones, the loop still keeps two plans
    in flight (the constrained sequence sits out every other one); its output matches the grammar
    and equals what it gives alone on the lockstep server (same seed)."""
    stub = stub_for(tiny_server)
    plain = [asyncio.ensure_future(complete(stub, greedy_ids_request(p, 300))) for p in PROMPTS]
    await asyncio.sleep(0.3)  # the plain requests are admitted and decoding
    chunks, in_flight_while_constrained = [], 0
    loop = tiny_server.loop
    async for chunk in stub.Generate(_constrained_request(LONG_REGEX, 5, "grammar-overlap")):
        running = loop.scheduler.find("grammar-overlap") is not None
        if not chunks:  # admitted: from here on a grammar runs
            loop.max_in_flight_seen = 0
        elif running:  # read in the same event-loop turn: nothing stepped in between
            in_flight_while_constrained = loop.max_in_flight_seen
        chunks.append(chunk)
    assert not all(task.done() for task in plain)  # the plain requests ran all along
    await asyncio.gather(*plain)
    text = "".join(c.text for c in chunks)
    assert re.fullmatch(LONG_REGEX, text), text
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_EOS
    assert in_flight_while_constrained == 2
    alone = await complete(stub_for(lockstep_server), _constrained_request(LONG_REGEX, seed=5))
    assert [t for c in chunks for t in c.token_ids] == alone.token_ids
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_aborting_a_constrained_request_with_plans_in_flight_frees_every_block(tiny_server):
    stub = stub_for(tiny_server)
    plain = asyncio.ensure_future(complete(stub, greedy_ids_request(PROMPTS[0], 120)))
    call = stub.Generate(_constrained_request(LONG_REGEX, seed=1, request_id="grammar-abort"))
    seen = 0
    async for chunk in call:
        seen += len(chunk.token_ids)
        if seen >= 3:
            await stub.Abort(generate_pb2.AbortRequest(request_id="grammar-abort"))
            break
    chunks = [c async for c in call]
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_CANCELLED
    assert len((await plain).token_ids) == 120
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)
