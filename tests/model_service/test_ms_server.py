"""A real model server on 127.0.0.1 (tiny model): Describe, Execute steps, a bad plan."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import tiny_config
from model_service.attention import paged as attention
from model_service.kernels import layer_ops
from model_service.start import build_runner
from model_service.server import serve, shutdown
from planserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc


@pytest.fixture
async def engine(tiny_loaded):
    config = tiny_config(port=0)
    server = await serve(config, runner=build_runner(tiny_loaded, config))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}")
    yield channel
    await channel.close()
    await shutdown(server, grace_s=0.5)


def _plan(step_id, **fields):
    return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(step_id=step_id, **fields))


async def test_describe_and_health(engine):
    stub = engine_pb2_grpc.EngineServiceStub(engine)
    facts = await stub.Describe(engine_pb2.DescribeRequest())
    assert facts.contract_version == 1
    assert (facts.vocab_size, facts.max_model_len, facts.block_size, facts.num_kv_blocks, facts.max_num_slots) == (49152, 512, 16, 512, 16)
    assert facts.features.chunked_prefill and facts.features.block_copy
    assert list(facts.eos_token_ids) == [2] and not facts.HasField("bos_token_id")
    assert facts.tokenizer_json.startswith("{") and "<|im_start|>" in facts.chat_template
    assert facts.special_tokens["eos_token"] == "<|im_end|>"
    assert facts.device == "cpu" and facts.dtype == "float32" and facts.architecture == "LlamaForCausalLM"
    assert facts.compute["torch_threads"] == str(torch.get_num_threads())
    assert facts.compute["attention"] == attention.resolve_isa("auto") and facts.compute["layer_ops"] == layer_ops.resolve_isa("auto")
    assert {"omp_wait_policy", "gomp_spincount", "omp_num_threads"} <= facts.compute.keys()
    assert facts.compute["gemm"] == "torch"  # float32: torch's GEMM (the packed one is bf16's)
    health = health_pb2_grpc.HealthStub(engine)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_execute_steps_then_bad_plan(engine):
    stub = engine_pb2_grpc.EngineServiceStub(engine)
    sampling = common_pb2.SamplingParams(temperature=0.0, seed=3)
    plans = [
        _plan(0, new_sequences=[engine_pb2.NewSequence(slot=0, token_ids=list(range(10, 30)), sampling=sampling)],
              slots=[0], num_scheduled_tokens=[16], num_new_blocks=[1], new_block_ids=[1]),
        _plan(1, slots=[0], num_scheduled_tokens=[4], num_new_blocks=[1], new_block_ids=[2]),
        _plan(2, new_sequences=[engine_pb2.NewSequence(slot=1, token_ids=[7, 8, 9], sampling=sampling)],
              slots=[0, 1], num_scheduled_tokens=[1, 3], num_new_blocks=[0, 1], new_block_ids=[3]),
        _plan(3, slots=[0, 1], num_scheduled_tokens=[1, 1], num_new_blocks=[0, 0]),
        _plan(4, finished_slots=[1], slots=[0], num_scheduled_tokens=[1], num_new_blocks=[0]),
        _plan(5, slots=[9], num_scheduled_tokens=[1], num_new_blocks=[0]),  # slot 9 was never registered
    ]
    queue: asyncio.Queue = asyncio.Queue()
    for p in plans:
        queue.put_nowait(p)

    async def requests():
        while not queue.empty():
            yield await queue.get()

    call = stub.Execute(requests())
    results = []
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for response in call:
            results.append(response.result)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("slots:")
    assert [r.step_id for r in results] == [0, 1, 2, 3, 4]
    assert [list(r.num_sampled_tokens) for r in results] == [[0], [1], [1, 1], [1, 1], [1]]
    assert all(r.total_ns >= r.forward_ns > 0 for r in results)
    # The stream ended, so its slots are gone: slot 0 can be registered again on a new stream.
    again = stub.Execute(iter([plans[0]]))
    assert [r.result.step_id async for r in again] == [0]


async def test_second_stream_is_refused(engine):
    stub = engine_pb2_grpc.EngineServiceStub(engine)
    gate = asyncio.Event()

    async def held_open():
        yield _plan(0)
        await gate.wait()

    async def silent():
        await gate.wait()
        return
        yield  # an async generator that writes no plan

    first = stub.Execute(held_open())
    assert (await first.read()).result.step_id == 0
    # The second stream writes nothing: the server refuses it on opening, and a plan written at
    # that moment races the refusal (grpc.aio then reports the failed write as INTERNAL).
    second = stub.Execute(silent())
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in second:
            pass
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    gate.set()
    first.cancel()
