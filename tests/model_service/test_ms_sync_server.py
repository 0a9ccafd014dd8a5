"""The model service's synchronous gRPC server (a real server on 127.0.0.1, tiny model): each
Execute stream steps on its own handler thread, so these check what that thread owes the rest of
the server: a bad plan ends only its stream and a new one opens at once; a client that goes
away mid-stream (its call cancelled, or its channel closed) leaves the server serving, its slots
dropped; Describe and health answer while a stream is open; shutdown ends an open stream."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import tiny_config
from model_service.server import serve, shutdown
from model_service.start import build_runner
from planserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc

SAMPLING = common_pb2.SamplingParams(temperature=0.0, seed=3)


@pytest.fixture
async def server(tiny_loaded):
    config = tiny_config(port=0)
    started = await serve(config, runner=build_runner(tiny_loaded, config))
    yield started
    await shutdown(started, grace_s=0.5)


def _channel(server) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}")


def _register(step_id: int, slot: int = 0) -> engine_pb2.ExecuteRequest:
    """A plan that registers `slot` (refused if the slot is still registered)."""
    return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
        step_id=step_id,
        new_sequences=[engine_pb2.NewSequence(slot=slot, token_ids=list(range(10, 20)), sampling=SAMPLING)],
        slots=[slot], num_scheduled_tokens=[10], num_new_blocks=[1], new_block_ids=[1 + slot]))


def _decode(step_id: int, slot: int = 0) -> engine_pb2.ExecuteRequest:
    return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
        step_id=step_id, slots=[slot], num_scheduled_tokens=[1], num_new_blocks=[0]))


async def _held_stream(stub, gate: asyncio.Event):
    """An Execute stream that has run its first plan (slot 0 registered) and stays open, sending
    nothing more, until `gate` is set."""

    async def plans():
        yield _register(0)
        await gate.wait()

    call = stub.Execute(plans())
    assert (await call.read()).result.step_id == 0
    return call


async def _fresh_stream_steps(server) -> list[int]:
    """Registers slot 0 on a new stream, from a new channel; retries while the server has not yet
    seen the previous stream end (FAILED_PRECONDITION), at most 100 times. Each plan is written
    after the previous result is read, so a refusal is the call's status, never the client's
    failed write of a plan after it."""
    async with _channel(server) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        for _ in range(100):
            call = stub.Execute()
            steps = []
            try:
                for plan in (_register(0), _decode(1)):
                    await call.write(plan)
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        break
                    steps.append(response.result.step_id)
                else:
                    await call.done_writing()
                    return steps
            except grpc.aio.AioRpcError:
                pass
            if await call.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise AssertionError(
                    f"stream ended with {await call.code()} {await call.details()!r}: {steps}"
                )
            await asyncio.sleep(0.05)
    raise AssertionError("the previous stream never ended on the server")


async def test_a_bad_plan_ends_its_stream_with_the_field_and_the_next_stream_opens_at_once(server):
    async with _channel(server) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        bad = engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
            step_id=2, slots=[0], num_scheduled_tokens=[1, 1], num_new_blocks=[0]))
        results = []
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for response in stub.Execute(iter([_register(0), _decode(1), bad, _decode(3)])):
                results.append(response.result.step_id)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == "num_scheduled_tokens: length 2 != len(slots) 1"
        assert results == [0, 1]
        # The flag is cleared before the status is sent: no FAILED_PRECONDITION, and slot 0 (held
        # by the failed stream) can be registered again.
        again = [r.result.step_id async for r in stub.Execute(iter([_register(0)]))]
        assert again == [0]


@pytest.mark.parametrize("leave", ["cancel", "close_channel"])
async def test_a_client_that_leaves_mid_stream_leaves_the_server_serving(server, leave):
    channel = _channel(server)
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    gate = asyncio.Event()

    async def plans():
        yield _register(0)
        yield _decode(1)
        await gate.wait()  # the stream stays open on the server, its handler waiting for a plan

    call = stub.Execute(plans())
    assert (await call.read()).result.step_id == 0
    assert (await call.read()).result.step_id == 1
    if leave == "cancel":
        call.cancel()
    await channel.close()
    gate.set()
    # Slot 0 is registered again on a new stream: the left stream's slots were dropped.
    assert await _fresh_stream_steps(server) == [0, 1]
    async with _channel(server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_describe_and_health_answer_while_a_stream_is_open(server):
    async with _channel(server) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        gate = asyncio.Event()
        call = await _held_stream(stub, gate)
        health = health_pb2_grpc.HealthStub(channel)
        checks = await asyncio.gather(*(
            health.Check(health_pb2.HealthCheckRequest(service="planserve.v1.EngineService"))
            for _ in range(12)))  # more than the server's handler threads, at once
        assert {c.status for c in checks} == {health_pb2.HealthCheckResponse.SERVING}
        facts = await stub.Describe(engine_pb2.DescribeRequest())
        assert facts.max_num_slots == 16
        gate.set()
        call.cancel()


async def test_shutdown_ends_an_open_stream_and_reports_not_serving(tiny_loaded):
    config = tiny_config(port=0)
    started = await serve(config, runner=build_runner(tiny_loaded, config))
    async with _channel(started) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        gate = asyncio.Event()
        call = await _held_stream(stub, gate)
        await shutdown(started, grace_s=0.2)
        assert started.health.Check(health_pb2.HealthCheckRequest(service=""), None).status == (
            health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        assert error.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        gate.set()
