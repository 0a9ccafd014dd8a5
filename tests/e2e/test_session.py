"""The multiplexed Session stream, GetServerStatus and server reflection, on real servers."""
import asyncio

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from api import assert_no_leaked_blocks, complete, greedy_ids_request, stub_for, wait_until_idle
from planserve.v1 import generate_pb2


async def test_session_multiplexes_requests_survives_errors_and_aborts(tiny_server):
    stub = stub_for(tiny_server)
    outbox: asyncio.Queue = asyncio.Queue()

    async def messages():
        while (message := await outbox.get()) is not None:
            yield message

    call = stub.Session(messages())
    prompt_a, prompt_b = list(range(10, 30)), list(range(50, 61))
    outbox.put_nowait(generate_pb2.SessionRequest(
        generate=greedy_ids_request(prompt_a, 12, request_id="a")))
    outbox.put_nowait(generate_pb2.SessionRequest(
        generate=greedy_ids_request(prompt_b, 300, request_id="b")))
    outbox.put_nowait(generate_pb2.SessionRequest(  # rejected; the stream goes on
        generate=greedy_ids_request([1, 2], 0, request_id="bad")))
    tokens = {"a": [], "b": []}
    finals, errors, aborted = {}, [], False
    async for response in call:
        if response.HasField("error"):
            errors.append(response.error)
            continue
        chunk = response.chunk
        tokens[chunk.request_id].extend(chunk.token_ids)
        if len(tokens["b"]) >= 3 and not aborted:
            aborted = True
            outbox.put_nowait(generate_pb2.SessionRequest(
                abort=generate_pb2.AbortRequest(request_id="b")))
            outbox.put_nowait(generate_pb2.SessionRequest(
                abort=generate_pb2.AbortRequest(request_id="nobody")))
        if chunk.finish_reason:
            finals[chunk.request_id] = chunk.finish_reason
            if len(finals) == 2:
                outbox.put_nowait(None)  # done: half-close
    assert finals == {"a": generate_pb2.FINISH_REASON_LENGTH,
                      "b": generate_pb2.FINISH_REASON_CANCELLED}
    assert [(e.request_id, e.code) for e in errors] == [
        ("bad", grpc.StatusCode.INVALID_ARGUMENT.value[0]),
        ("nobody", grpc.StatusCode.NOT_FOUND.value[0])]
    assert "stopping.max_new_tokens" in errors[0].message
    # Multiplexing changes nothing in what a request gets.
    alone = await complete(stub, greedy_ids_request(prompt_a, 12))
    assert tokens["a"] == alone.token_ids
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_closing_a_session_aborts_its_requests(tiny_server):
    stub = stub_for(tiny_server)
    call = stub.Session(iter([generate_pb2.SessionRequest(
        generate=greedy_ids_request(list(range(1, 30)), 400, request_id="long"))]))
    await call.read()
    call.cancel()
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_server_status_reports_load(tiny_server):
    stub = stub_for(tiny_server)
    call = stub.Generate(greedy_ids_request(list(range(1, 40)), 300))
    await call.read()
    busy = await stub.GetServerStatus(generate_pb2.GetServerStatusRequest())
    assert busy.num_running == 1 and busy.num_waiting == 0
    assert busy.num_free_kv_blocks < busy.num_kv_blocks
    assert 0 < busy.kv_cache_usage <= 1
    call.cancel()
    await wait_until_idle(tiny_server)
    idle = await stub.GetServerStatus(generate_pb2.GetServerStatusRequest())
    assert idle.num_running == 0 and idle.kv_cache_usage == 0


async def test_reflection_lists_the_services(tiny_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tiny_server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for r in responses for s in r.list_services_response.service}
    assert {"planserve.v1.GenerationService", "grpc.health.v1.Health"} <= names
