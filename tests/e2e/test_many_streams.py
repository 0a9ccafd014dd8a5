"""256 concurrent streams on the null model, whose tokens depend on each stream's own prompt:
every stream gets exactly its own tokens, in order, none twice and none missing, however its
outputs were merged into chunks; the KV blocks all return to the pool. On gRPC (Generate and
Session) and as the HTTP API's server-sent events."""
import asyncio
import json

import grpc
import pytest
import pytest_asyncio
from api import (
    assert_no_leaked_blocks,
    greedy_ids_request,
    sse_request,
    stub_for,
    wait_until_idle,
)
from conftest import EngineProcess, start_scheduler

from model_service.models.null import null_continuation
from planserve.v1 import generate_pb2, generate_pb2_grpc

NUM_STREAMS = 256
NUM_TOKENS = 40


def _prompt(i: int) -> list[int]:
    """Prompts whose continuations all differ: length and last token differ modulo 26."""
    return [7] * (4 + i % 26) + [32 + i // 26]


@pytest.fixture(scope="module")
def engine():
    process = EngineProcess("--model", "null", "--null-step-delay-ms", "2",
                            "--max-num-slots", str(NUM_STREAMS))
    yield process.address
    process.stop()


@pytest_asyncio.fixture(params=[0, 2], ids=["doors_in_process", "two_frontend_processes"])
async def server(engine, request):
    """The default layout, and the doors in two frontend processes (scheduler_service/frontends):
    the core's scheduler is this process's either way (what the block checks read)."""
    server = await start_scheduler(engine, max_num_seqs=NUM_STREAMS, max_queue_len=4 * NUM_STREAMS,
                                   max_num_batched_tokens=4096, frontend_processes=request.param,
                                   http_port=0)
    yield server
    await server.stop(grace_s=1)


def test_the_prompts_continue_differently():
    continuations = {tuple(null_continuation(_prompt(i), NUM_TOKENS)) for i in range(NUM_STREAMS)}
    assert len(continuations) == NUM_STREAMS


async def _read(stub, i: int) -> tuple[list[int], str, int, int]:
    ids, texts, chunks, reason = [], [], 0, 0
    async for chunk in stub.Generate(greedy_ids_request(_prompt(i), NUM_TOKENS,
                                                        request_id=f"many-{i}")):
        assert chunk.request_id == f"many-{i}"
        ids.extend(chunk.token_ids)
        texts.append(chunk.text)
        chunks += 1
        reason = chunk.finish_reason or reason
    return ids, "".join(texts), chunks, reason


async def test_256_generate_streams_each_get_exactly_their_own_tokens(server):
    stub = stub_for(server)
    done = await asyncio.gather(*(_read(stub, i) for i in range(NUM_STREAMS)))
    for i, (ids, text, chunks, reason) in enumerate(done):
        assert ids == null_continuation(_prompt(i), NUM_TOKENS), i
        assert text == bytes(ids).decode()
        assert 1 <= chunks <= NUM_TOKENS
        assert reason == generate_pb2.FINISH_REASON_LENGTH
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_256_requests_on_one_session_each_get_exactly_their_own_tokens(server):
    stub = stub_for(server)
    messages = [generate_pb2.SessionRequest(generate=greedy_ids_request(
        _prompt(i), NUM_TOKENS, request_id=f"s-{i}")) for i in range(NUM_STREAMS)]
    ids: dict[str, list[int]] = {m.generate.request_id: [] for m in messages}
    finished = set()
    async for response in stub.Session(iter(messages)):
        chunk = response.chunk
        assert chunk.request_id not in finished  # nothing after a request's final chunk
        ids[chunk.request_id].extend(chunk.token_ids)
        if chunk.finish_reason:
            finished.add(chunk.request_id)
    assert len(finished) == NUM_STREAMS
    for i in range(NUM_STREAMS):
        assert ids[f"s-{i}"] == null_continuation(_prompt(i), NUM_TOKENS), i
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_a_slow_reader_gets_its_missed_tokens_merged_and_the_others_go_on(server):
    """The slow client's channel takes little before gRPC's flow control holds the server's
    writes, so its outputs wait on the server while it sleeps; they come merged, complete."""
    options = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        slow = generate_pb2_grpc.GenerationServiceStub(channel)
        request = greedy_ids_request(_prompt(0), 200, request_id="slow")
        stream = slow.Generate(request)
        first = await stream.read()
        others = await asyncio.gather(*(_read(stub_for(server), i) for i in range(1, 64)))
        for i, (ids, _, _, reason) in enumerate(others, start=1):
            assert ids == null_continuation(_prompt(i), NUM_TOKENS)
            assert reason == generate_pb2.FINISH_REASON_LENGTH
        await asyncio.sleep(1.0)  # the slow reader's request runs on meanwhile
        ids, chunks = list(first.token_ids), 1
        while (chunk := await stream.read()) is not grpc.aio.EOF:
            ids.extend(chunk.token_ids)
            chunks += 1
    assert ids == null_continuation(_prompt(0), 200)
    assert chunks < 200  # what it missed came merged
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


def _sse_body(server, i: int, num_tokens: int) -> dict:
    return {"model": server.servicer.serving.facts.model_name, "prompt": _prompt(i), "max_tokens": num_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def test_256_sse_streams_each_get_exactly_their_own_text(server):
    streams = await asyncio.gather(*(
        sse_request(server.http_port, "/v1/completions", _sse_body(server, i, NUM_TOKENS))
        for i in range(NUM_STREAMS)))
    for i, stream in enumerate(streams):
        assert stream.text() == bytes(null_continuation(_prompt(i), NUM_TOKENS)).decode(), i
        assert stream.events[-1] == "[DONE]"
        assert json.loads(stream.events[-2])["choices"][0]["finish_reason"] == "length"
        assert 2 <= stream.num_http_chunks <= NUM_TOKENS + 1
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_a_slow_sse_reader_gets_all_its_text_and_the_others_go_on(server):
    """A client that stops reading for a while: the others finish meanwhile, and it gets its
    whole text when it reads again. (Its missed outputs merge only once the kernel's socket
    buffers are full, megabytes on loopback: tests/scheduler/test_sse_direct_sink.py shows
    the merge behind a socket that holds back.)"""
    slow = asyncio.ensure_future(sse_request(server.http_port, "/v1/completions",
                                             _sse_body(server, 0, 400), receive_buffer=2048,
                                             pause_s=2.0))
    others = await asyncio.gather(*(
        sse_request(server.http_port, "/v1/completions", _sse_body(server, i, NUM_TOKENS))
        for i in range(1, 64)))
    assert not slow.done()
    for i, stream in enumerate(others, start=1):
        assert stream.text() == bytes(null_continuation(_prompt(i), NUM_TOKENS)).decode(), i
    stream = await slow
    assert stream.text() == bytes(null_continuation(_prompt(0), 400)).decode()
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)
