"""Run-time LoRA loading (`--enable-runtime-lora`) behind `--frontend-processes 2`, a scheduler
core in this process and a real tiny model service with LoRA: a load or an unload sent to either
frontend is the core's (its checks, its refusals), and once the caller is answered every
frontend knows: the adapter is listed and applied on every connection, then unknown on every
connection after the unload; no KV block leaks."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from api import assert_no_leaked_blocks, complete, greedy_ids_request, wait_until_idle
from conftest import EngineProcess, start_scheduler
from lora_adapters import ATTENTION, save_adapter
from planserve.v1 import generate_pb2, generate_pb2_grpc

# Connections spread over both frontends (the kernel gives each to one of them).
NUM_CHANNELS = 8


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model
    from reference import hf_llama_from_loaded

    reference = hf_llama_from_loaded(load_model(ModelServiceConfig(model="tiny", dtype="float32")))
    root = tmp_path_factory.mktemp("lora")
    save_adapter(reference, str(root / "a1"), rank=4, targets=ATTENTION, seed=1)
    return root


async def test_runtime_lora_load_and_unload_through_either_frontend(adapter_root):
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64",
                           "--enable-lora", "--max-loras", "2")
    channels: list[grpc.aio.Channel] = []
    try:
        server = await start_scheduler(engine.address, frontend_processes=2,
                                       enable_runtime_lora=True, lora_root=str(adapter_root))
        try:
            channels = [grpc.aio.insecure_channel(
                f"127.0.0.1:{server.port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(NUM_CHANNELS)]
            stubs = [generate_pb2_grpc.GenerationServiceStub(c) for c in channels]
            path = str(adapter_root / "a1")
            loaded = await stubs[0].LoadLoraAdapter(
                generate_pb2.LoadLoraAdapterRequest(lora_name="a1", lora_path=path))
            assert (loaded.adapter.name, loaded.adapter.rank) == ("a1", 4)
            prompt = [1, 17, 300, 4000]
            base = (await complete(stubs[0], greedy_ids_request(prompt, 8))).token_ids
            tuned = []
            for stub in stubs:
                info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
                assert [a.name for a in info.lora_adapters] == ["a1"]
                out = await complete(stub, greedy_ids_request(prompt, 8, lora_name="a1"))
                tuned.append(out.token_ids)
                # The core's registry refuses a second load of the name, whichever frontend.
                with pytest.raises(grpc.aio.AioRpcError) as again:
                    await stub.LoadLoraAdapter(
                        generate_pb2.LoadLoraAdapterRequest(lora_name="a1", lora_path=path))
                assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS
                assert "already loaded" in again.value.details()
            assert tuned == [tuned[0]] * NUM_CHANNELS and tuned[0] != base
            with pytest.raises(grpc.aio.AioRpcError) as outside:
                await stubs[1].LoadLoraAdapter(
                    generate_pb2.LoadLoraAdapterRequest(lora_name="a2", lora_path="/etc"))
            assert outside.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await stubs[NUM_CHANNELS - 1].UnloadLoraAdapter(
                generate_pb2.UnloadLoraAdapterRequest(lora_name="a1"))
            for stub in stubs:
                with pytest.raises(grpc.aio.AioRpcError) as gone:
                    await complete(stub, greedy_ids_request(prompt, 2, lora_name="a1"))
                assert gone.value.code() == grpc.StatusCode.NOT_FOUND
                info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
                assert not info.lora_adapters
            await wait_until_idle(server)
            assert_no_leaked_blocks(server)
        finally:
            await asyncio.gather(*(c.close() for c in channels))
            await server.stop(grace_s=1)
    finally:
        engine.stop()
