"""The null model (`--model null`) behind a real scheduler: deterministic tokens, streamed."""
import asyncio

import pytest
import pytest_asyncio
from api import complete, greedy_ids_request, stub_for
from conftest import EngineProcess, start_scheduler

from model_service.models.null import EOS_ID, null_continuation
from planserve.v1 import generate_pb2


@pytest.fixture(scope="module")
def null_engine():
    engine = EngineProcess("--model", "null", "--null-step-delay-ms", "1")
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def null_server(null_engine):
    server = await start_scheduler(null_engine, max_num_seqs=64)
    yield server
    await server.stop(grace_s=1)


@pytest.fixture(scope="module")
def null_eos_engine():
    engine = EngineProcess("--model", "null", "--null-eos-at", "12")
    yield engine.address
    engine.stop()


async def test_streams_the_deterministic_letters_token_by_token(null_server):
    stub = stub_for(null_server)
    prompt = [1, 2, 3, 4, 5]
    chunks = [c async for c in stub.Generate(greedy_ids_request(prompt, 30))]
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == null_continuation(prompt, 30)
    assert ids[:3] == list(b"kjj")  # after 5 at position 4: letter (4 + 1 + 5) % 26 = 10, "k"
    # One token a chunk at the default stream_interval, unless a chunk's write outlasts the next
    # 1 ms step (a loaded machine, or a frontend process's write): the stream then merges the
    # outputs it missed (api/streams.py): fewer chunks, the same tokens.
    assert 1 <= len(chunks) <= 30 and all(c.token_ids for c in chunks)
    assert "".join(c.text for c in chunks) == bytes(ids).decode()
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


async def test_concurrent_requests_each_get_their_own_continuation(null_server):
    stub = stub_for(null_server)
    lengths = [1 + 7 * i for i in range(40)]
    done = await asyncio.gather(*(complete(stub, greedy_ids_request([(10 + i) % 256 for i in range(n)], 20 + n % 5)) for n in lengths))
    for n, completion in zip(lengths, done):
        assert completion.token_ids == null_continuation([(10 + i) % 256 for i in range(n)], 20 + n % 5)


async def test_text_prompts_use_the_byte_tokenizer_and_sampling_does_not_change_tokens(null_server):
    stub = stub_for(null_server)
    request = generate_pb2.GenerateRequest(text="hello")
    request.sampling.temperature = 1.0
    request.sampling.seed = 7
    request.stopping.max_new_tokens = 26
    completion = await complete(stub, request)
    assert completion.usage.prompt_tokens == 5
    assert completion.token_ids == null_continuation(list(b"hello"), 26)


async def test_eos_only_when_asked(null_eos_engine):
    server = await start_scheduler(null_eos_engine)
    try:
        stub = stub_for(server)
        stopped_request = greedy_ids_request([9] * 4, 50)
        stopped_request.stopping.ignore_eos = False
        stopped = await complete(stub, stopped_request)
        assert stopped.finish_reason == generate_pb2.FINISH_REASON_EOS
        # Generated positions 4..11 are letters, position 12 is EOS.
        assert stopped.token_ids == null_continuation([9] * 4, 8) + [EOS_ID]
        ignored = await complete(stub, greedy_ids_request([9] * 4, 10))  # ignore_eos
        assert ignored.token_ids[8:] == [EOS_ID, EOS_ID]
    finally:
        await server.stop(grace_s=1)


@pytest.fixture(scope="module")
def null_ahead_engine():
    """The null model's delay queued as a GPU queues its steps (launch-ahead over the padded
    steps): the forward returns at once and a launched step is done when its delay has run."""
    engine = EngineProcess("--model", "null", "--null-step-delay-ms", "2", "--cuda-graphs",
                           "eager", "--launch-ahead", "on")
    yield engine.address
    engine.stop()


async def test_steps_launched_ahead_on_the_null_models_queue_keep_every_continuation(
        null_ahead_engine):
    """Each step's input token is the token the step before sampled (taken on the device while
    that step is still queued): every continuation depends on it, so one taken wrongly, late or
    from another stream changes the letters."""
    server = await start_scheduler(null_ahead_engine, max_num_seqs=64)
    try:
        stub = stub_for(server)
        lengths = [1 + 7 * i for i in range(40)]
        prompts = [[(10 + i) % 256 for i in range(n)] for n in lengths]
        done = await asyncio.gather(*(complete(stub, greedy_ids_request(p, 24 + len(p) % 5))
                                      for p in prompts))
        for prompt, completion in zip(prompts, done):
            assert completion.token_ids == null_continuation(prompt, 24 + len(prompt) % 5)
    finally:
        await server.stop(grace_s=1)
