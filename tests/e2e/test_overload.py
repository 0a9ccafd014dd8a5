"""Overload on real servers: the waiting queue's token bound answers RESOURCE_EXHAUSTED with a
retry hint, and a client that stops reading is cut off at its stream's bound while the others
go on."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from google.rpc import error_details_pb2
from grpc_status import rpc_status

from api import assert_no_leaked_blocks, complete, greedy_ids_request, wait_until_idle
from conftest import EngineProcess, start_scheduler
from planserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.api.overload import RETRY_AFTER_KEY

MAX_QUEUE_TOKENS = 100
MAX_STREAM_BUFFER_CHUNKS = 8
MAX_QUEUE_LEN = 2


@pytest.fixture(scope="module")
def engine():
    process = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    yield process.address
    process.stop()


@pytest_asyncio.fixture(scope="module")
async def server(engine):
    # One sequence at a time, so that everything else waits in the queue.
    server = await start_scheduler(engine, max_num_seqs=1, max_queue_tokens=MAX_QUEUE_TOKENS,
                                   max_stream_buffer_chunks=MAX_STREAM_BUFFER_CHUNKS,
                                   max_queue_len=MAX_QUEUE_LEN)
    yield server
    await server.stop(grace_s=1)


def _stub(server, *options) -> generate_pb2_grpc.GenerationServiceStub:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=list(options))
    return generate_pb2_grpc.GenerationServiceStub(channel)


async def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


async def test_queue_full_by_tokens_answers_resource_exhausted_with_a_retry_hint(server):
    stub = _stub(server)
    scheduler = server.loop.scheduler
    running = stub.Generate(greedy_ids_request(list(range(1, 9)), 400))
    await running.read()  # admitted: it holds the only sequence
    waiting = asyncio.ensure_future(complete(stub, greedy_ids_request(list(range(1, 61)), 4)))
    await _wait_for(lambda: scheduler.num_waiting == 1)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await complete(stub, greedy_ids_request(list(range(1, 51)), 4))  # 60 + 50 > 100
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"max_queue_tokens {MAX_QUEUE_TOKENS}" in error.value.details()
    hint = dict(error.value.trailing_metadata())[RETRY_AFTER_KEY]
    assert 100 <= int(hint) <= 30_000
    assert f"retry after {hint} ms" in error.value.details()
    # The same hint as the standard rich status: google.rpc.RetryInfo.
    status = rpc_status.from_call(error.value)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    [detail] = status.details
    info = error_details_pb2.RetryInfo()
    assert detail.Unpack(info)
    assert info.retry_delay.ToMilliseconds() == int(hint)
    # A smaller request still fits (60 + 40 = 100), and everyone is served.
    small = await asyncio.gather(complete(stub, greedy_ids_request(list(range(1, 41)), 4)),
                                 waiting)
    assert [len(c.token_ids) for c in small] == [4, 4]
    running.cancel()
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_queue_full_by_requests_answers_resource_exhausted_with_a_retry_hint(server):
    stub = _stub(server)
    scheduler = server.loop.scheduler
    running = stub.Generate(greedy_ids_request(list(range(1, 9)), 400))
    await running.read()
    waiting = [asyncio.ensure_future(complete(stub, greedy_ids_request([1, 2, 3], 2)))
               for _ in range(MAX_QUEUE_LEN)]
    await _wait_for(lambda: scheduler.num_waiting == MAX_QUEUE_LEN)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await complete(stub, greedy_ids_request([1, 2, 3], 2))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{MAX_QUEUE_LEN} requests waiting (max_queue_len {MAX_QUEUE_LEN})" in \
        error.value.details()
    assert int(dict(error.value.trailing_metadata())[RETRY_AFTER_KEY]) >= 100
    assert server.metrics.registry.get_sample_value(
        "planserve_requests_rejected_total", {"reason": "queue_full"}) >= 1
    running.cancel()
    assert [len(c.token_ids) for c in await asyncio.gather(*waiting)] == [2] * MAX_QUEUE_LEN
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_client_that_stops_reading_is_aborted_at_the_bound_and_others_go_on(server):
    # A small HTTP/2 window on the slow client's side, so that the server's writes block soon
    # and chunks pile up in the stream's buffer (a real client's window is 64 KiB and more).
    slow_stub = _stub(server, ("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0))
    scheduler = server.loop.scheduler
    slow = slow_stub.Generate(greedy_ids_request(list(range(1, 9)), 450, request_id="slow"))
    await slow.read()
    # The slow request is running and then aborted at the bound: it leaves the scheduler while
    # its client has not read anything more.
    await _wait_for(lambda: "slow" not in scheduler.requests)
    assert not slow.done()
    # Another client is served in full meanwhile.
    other = await complete(_stub(server), greedy_ids_request([5, 6, 7], 30))
    assert len(other.token_ids) == 30
    with pytest.raises(grpc.aio.AioRpcError) as error:
        while True:
            chunk = await slow.read()
            assert chunk is not grpc.aio.EOF, "the slow stream ended without a status"
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"max_stream_buffer_chunks {MAX_STREAM_BUFFER_CHUNKS}" in error.value.details()
    assert server.metrics.registry.get_sample_value(
        "planserve_requests_rejected_total", {"reason": "stream_buffer_full"}) >= 1
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_slow_session_is_aborted_at_the_bound(server):
    slow_stub = _stub(server, ("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0))
    scheduler = server.loop.scheduler
    outgoing: asyncio.Queue = asyncio.Queue()

    async def messages():
        while (message := await outgoing.get()) is not None:
            yield message

    session = slow_stub.Session(messages())
    outgoing.put_nowait(generate_pb2.SessionRequest(
        generate=greedy_ids_request(list(range(1, 9)), 450, request_id="slow-session")))
    await session.read()
    await _wait_for(lambda: "slow-session" not in scheduler.requests)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        while True:
            assert await session.read() is not grpc.aio.EOF
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_stream_buffer_chunks" in error.value.details()
    outgoing.put_nowait(None)
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)
