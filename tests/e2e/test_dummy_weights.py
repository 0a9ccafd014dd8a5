"""A dummy-weight model (`--load-format dummy`) behind a real scheduler: tokens stream, and
Describe says the weights are dummy."""
import grpc
import pytest
import pytest_asyncio
from api import complete, greedy_ids_request, stub_for
from conftest import EngineProcess, start_scheduler

from planserve.v1 import engine_pb2, engine_pb2_grpc, generate_pb2


@pytest.fixture(scope="module")
def dummy_engine():
    engine = EngineProcess("--model", "tiny", "--load-format", "dummy", "--dummy-seed", "5",
                           "--dtype", "float32", "--num-kv-blocks", "64")
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def dummy_server(dummy_engine):
    server = await start_scheduler(dummy_engine, max_num_batched_tokens=64, max_num_seqs=8)
    yield server
    await server.stop(grace_s=1)


async def test_tokens_stream_and_describe_names_the_dummy_weights(dummy_engine, dummy_server):
    stub = stub_for(dummy_server)
    chunks = [c async for c in stub.Generate(greedy_ids_request([11, 12, 13, 14], 12))]
    assert len(chunks) == 12 and all(len(c.token_ids) == 1 for c in chunks)
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    again = await complete(stub, greedy_ids_request([11, 12, 13, 14], 12))
    assert again.token_ids == [c.token_ids[0] for c in chunks]  # greedy, same seeded weights
    async with grpc.aio.insecure_channel(dummy_engine) as channel:
        facts = await engine_pb2_grpc.EngineServiceStub(channel).Describe(
            engine_pb2.DescribeRequest())
    assert facts.model_name == "dummy-tiny"
    assert facts.compute["weights"] == "dummy (seed 5, normal std 0.02)"
