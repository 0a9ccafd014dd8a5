"""LoRA over a real model server on 127.0.0.1 (tiny model, --enable-lora): Describe's
capacity, LoadAdapter and EvictAdapter with their status codes, and an Execute stream whose
sequences name an adapter and the base model, a load answered while the stream is open."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from conftest import tiny_config
from lora_adapters import ALL_LINEAR, save_adapter
from model_service.lora.targets import TARGET_MODULES
from model_service.server import serve, shutdown
from model_service.start import build_runner
from planserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc


@pytest.fixture(scope="module")
def adapter_folder(tiny_hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters") / "all4"
    save_adapter(tiny_hf, str(folder), 4, ALL_LINEAR, seed=5)
    return str(folder)


@pytest.fixture
async def engine(tiny_loaded):
    config = tiny_config(port=0, enable_lora=True, max_loras=2, max_cpu_loras=2)
    server = await serve(config, runner=build_runner(tiny_loaded, config))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}")
    yield engine_pb2_grpc.EngineServiceStub(channel)
    await channel.close()
    await shutdown(server, grace_s=0.5)


async def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value.code(), error.value.details()


async def test_load_evict_and_refusals_over_grpc(engine, adapter_folder, tmp_path):
    facts = await engine.Describe(engine_pb2.DescribeRequest())
    assert (facts.lora.max_loras, facts.lora.max_lora_rank, facts.lora.max_cpu_loras) == (2, 16, 2)
    assert list(facts.lora.target_modules) == list(TARGET_MODULES)
    reply = await engine.LoadAdapter(engine_pb2.LoadAdapterRequest(lora_id=1, lora_name="a", lora_path=adapter_folder))
    assert reply.rank == 4 and list(reply.target_modules) == list(TARGET_MODULES) and reply.num_bytes == 49152  # fused B blocks, zeros included
    code, details = await _code(engine.LoadAdapter(engine_pb2.LoadAdapterRequest(lora_id=1, lora_name="a",
                                                                                 lora_path=adapter_folder)))
    assert code == grpc.StatusCode.ALREADY_EXISTS and details.startswith("lora_id: 1")
    code, details = await _code(engine.LoadAdapter(engine_pb2.LoadAdapterRequest(lora_id=2, lora_name="b",
                                                                                 lora_path=str(tmp_path / "none"))))
    assert code == grpc.StatusCode.NOT_FOUND and details.startswith("lora_path:")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"pickle")
    code, details = await _code(engine.LoadAdapter(engine_pb2.LoadAdapterRequest(lora_id=2, lora_name="b",
                                                                                 lora_path=str(tmp_path / "bin"))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("adapter_model.bin:")
    await engine.EvictAdapter(engine_pb2.EvictAdapterRequest(lora_id=1))
    code, details = await _code(engine.EvictAdapter(engine_pb2.EvictAdapterRequest(lora_id=1)))
    assert code == grpc.StatusCode.NOT_FOUND


async def test_execute_with_adapters_while_loading(engine, adapter_folder):
    await engine.LoadAdapter(engine_pb2.LoadAdapterRequest(lora_id=1, lora_name="a", lora_path=adapter_folder))
    sampling = common_pb2.SamplingParams(temperature=0.0, seed=3)
    prompt = list(range(10, 30))
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
        step_id=0,
        new_sequences=[engine_pb2.NewSequence(slot=0, token_ids=prompt, sampling=sampling, lora_id=1),
                       engine_pb2.NewSequence(slot=1, token_ids=prompt, sampling=sampling)],
        slots=[0, 1], num_scheduled_tokens=[20, 20], num_new_blocks=[2, 2], new_block_ids=[1, 2, 3, 4])))

    async def requests():
        while True:
            request = await queue.get()
            if request is None:
                return
            yield request

    call = engine.Execute(requests())
    first = (await call.read()).result
    # A second adapter loads while the stream is open; the next step uses it.
    await engine.LoadAdapter(engine_pb2.LoadAdapterRequest(lora_id=2, lora_name="b", lora_path=adapter_folder))
    queue.put_nowait(engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
        step_id=1, new_sequences=[engine_pb2.NewSequence(slot=2, token_ids=prompt, sampling=sampling, lora_id=2)],
        slots=[2], num_scheduled_tokens=[20], num_new_blocks=[2], new_block_ids=[5, 6])))
    second = (await call.read()).result
    queue.put_nowait(engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
        step_id=2, new_sequences=[engine_pb2.NewSequence(slot=3, token_ids=prompt, sampling=sampling, lora_id=7)])))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call.read()
    queue.put_nowait(None)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("new_sequences[0].lora_id: adapter 7 is not loaded")
    lora_token, base_token = first.sampled_token_ids
    assert lora_token != base_token  # the adapter changes the model
    assert list(second.sampled_token_ids) == [lora_token]  # the same weights under id 2
