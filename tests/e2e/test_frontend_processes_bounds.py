"""The waiting queue's bounds behind `--frontend-processes 2` (a scheduler core in this process,
the null model): the core owns them, so requests racing for the last places through both
frontends get exactly the room there is, and each refused one gets the scheduler process's own
refusal on every door (gRPC Generate with its retry hint, a Session's error, HTTP 429); an id in
flight on one frontend is ALREADY_EXISTS on the other; /load reports the core's queue now."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest
import pytest_asyncio

from api import assert_no_leaked_blocks, complete, greedy_ids_request, wait_until_idle
from conftest import EngineProcess, start_scheduler
from planserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.api.overload import RETRY_AFTER_KEY

MAX_QUEUE_LEN = 3
NUM_RACING = 12
# Connections the racing requests are spread over: the kernel gives each to one frontend.
NUM_CHANNELS = 12
QUEUE_FULL = f"{MAX_QUEUE_LEN} requests waiting (max_queue_len {MAX_QUEUE_LEN})"


@pytest.fixture(scope="module")
def null_engine():
    engine = EngineProcess("--model", "null", "--null-step-delay-ms", "5")
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def server(null_engine):
    # One sequence at a time: while one long request holds it, everything else waits.
    server = await start_scheduler(null_engine, frontend_processes=2, max_num_seqs=1,
                                   max_queue_len=MAX_QUEUE_LEN, http_port=0)
    yield server
    await server.stop(grace_s=1)


def _stubs(server, n: int) -> tuple[list[grpc.aio.Channel], list]:
    """n channels, each its own connection (no shared subchannel)."""
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{server.port}",
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(n)]
    return channels, [generate_pb2_grpc.GenerationServiceStub(c) for c in channels]


async def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


async def _outcome(stub, i: int):
    try:
        return await complete(stub, greedy_ids_request([3, 4, 5 + i], 2, request_id=f"r-{i}"))
    except grpc.aio.AioRpcError as error:
        return error


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return json.loads(response.read())


def _rejected(server, reason: str) -> float:
    return server.metrics.registry.get_sample_value(
        "planserve_requests_rejected_total", {"reason": reason}) or 0.0


async def test_requests_racing_for_the_queue_through_two_frontends_get_exactly_its_room(server):
    scheduler = server.loop.scheduler
    channels, stubs = _stubs(server, NUM_CHANNELS)
    try:
        holder = stubs[0].Generate(greedy_ids_request([1, 2], 5000, request_id="holder"))
        await holder.read()  # running: it holds the only sequence
        refused_before = _rejected(server, "queue_full")
        # All at once, within a step or two: each frontend's snapshot still says the queue is
        # empty, so only the core can tell the fourth from the third.
        racing = [asyncio.ensure_future(_outcome(stubs[i % NUM_CHANNELS], i))
                  for i in range(NUM_RACING)]
        await _wait_for(lambda: sum(f.done() for f in racing) == NUM_RACING - MAX_QUEUE_LEN)
        assert scheduler.num_waiting == MAX_QUEUE_LEN
        refusals = [f.result() for f in racing if f.done()]
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in refusals), refusals
        for refusal in refusals:  # the scheduler process's refusal, word for word
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            hint = dict(refusal.trailing_metadata())[RETRY_AFTER_KEY]
            assert refusal.details() == f"queue full: {QUEUE_FULL}; retry after {hint} ms"
        assert _rejected(server, "queue_full") - refused_before == len(refusals)  # once each
        # /load through either frontend: the core's queue now.
        for _ in range(4):
            load = await asyncio.to_thread(_get, server.http_port, "/load")
            assert (load["num_requests_waiting"], load["num_requests_running"]) == (
                MAX_QUEUE_LEN, 1)
        # The other doors, with the queue full: a Session's error (the stream goes on) and 429.
        session = stubs[1].Session()
        await session.write(generate_pb2.SessionRequest(
            generate=greedy_ids_request([1, 2, 3], 2, request_id="in-session")))
        reply = await session.read()
        assert reply.error.request_id == "in-session", reply
        assert reply.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert QUEUE_FULL in reply.error.message
        await session.done_writing()
        assert await session.read() is grpc.aio.EOF
        for stream in (False, True):
            status, body = await asyncio.to_thread(
                _post, server.http_port, "/v1/completions",
                {"model": server.admission.serving.facts.model_name, "prompt": "abc",
                 "max_tokens": 2, "stream": stream})
            assert status == 429, body
            assert QUEUE_FULL in body["error"]["message"]
        holder.cancel()
        served = await asyncio.gather(*racing)
        assert [len(c.token_ids) for c in served if not isinstance(c, Exception)] == [2] * 3
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_an_id_in_flight_on_one_frontend_is_already_exists_on_either(server):
    """Before the core owned the check, a second frontend's duplicate got an error chunk."""
    channels, stubs = _stubs(server, NUM_CHANNELS)
    try:
        holder = stubs[0].Generate(greedy_ids_request([1, 2], 5000, request_id="twice"))
        await holder.read()
        for stub in stubs:  # the kernel puts some of these connections on the other frontend
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await complete(stub, greedy_ids_request([1, 2], 2, request_id="twice"))
            assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert error.value.details() == "request_id: 'twice' is already in flight"
        holder.cancel()
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)
