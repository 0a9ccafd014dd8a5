"""Helpers for tests that call the public API over real gRPC (and its HTTP API raw: sse_request)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from planserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.api.client import build_request  # noqa: F401  (re-exported for tests)


@dataclasses.dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: int
    usage: generate_pb2.Usage
    last: generate_pb2.GenerateResponse
    num_chunks: int


def stub_for(server) -> generate_pb2_grpc.GenerationServiceStub:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return generate_pb2_grpc.GenerationServiceStub(channel)


async def complete(stub, request: generate_pb2.GenerateRequest) -> Completion:
    token_ids, texts, chunks = [], [], []
    async for chunk in stub.Generate(request):
        chunks.append(chunk)
        token_ids.extend(chunk.token_ids)
        texts.append(chunk.text)
    last = chunks[-1]
    return Completion(chunks[0].request_id, token_ids, "".join(texts), last.finish_reason,
                      last.usage, last, len(chunks))


def greedy_ids_request(prompt_ids: list[int], max_new_tokens: int,
                       **kwargs) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(**kwargs)
    request.token_ids.ids.extend(prompt_ids)
    request.sampling.temperature = 0.0
    request.stopping.max_new_tokens = max_new_tokens
    request.stopping.ignore_eos = True
    return request


async def wait_until_idle(server, timeout_s: float = 5.0) -> None:
    """Waits for the scheduler to hold no request (aborts are applied at the next step)."""
    scheduler = server.loop.scheduler
    deadline = asyncio.get_running_loop().time() + timeout_s
    while scheduler.requests or scheduler.has_work():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"scheduler still busy: {list(scheduler.requests)}")
        await asyncio.sleep(0.01)


def assert_no_leaked_blocks(server) -> None:
    kv = server.loop.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks, (
        f"{kv.num_usable_blocks - kv.num_free_blocks} KV blocks leaked")


# Steps in flight (overlap, launch-ahead): what a server must do when the next step is computing
# before the last one's tokens are back. Each takes a server and a reference that answers step by
# step (or, for the tokens alone, any server of the same model).

async def staggered_greedy(server, prompts: list[list[int]],
                           max_new_tokens: int = 40) -> list[list[int]]:
    """Two start together, the others join while they decode; each one's greedy tokens."""
    stub = stub_for(server)
    first = [asyncio.ensure_future(complete(stub, greedy_ids_request(p, max_new_tokens)))
             for p in prompts[:2]]
    await asyncio.sleep(0.3)
    later = [asyncio.ensure_future(complete(stub, greedy_ids_request(p, max_new_tokens)))
             for p in prompts[2:]]
    return [c.token_ids for c in await asyncio.gather(*first, *later)]


async def assert_a_stop_in_flight_ends_exactly_there(server, reference, prompt: list[int]) -> None:
    """A stop token seen while the next step is computing: nothing past it is sent, and a
    request after it still counts its tokens right; no block leaks."""
    expected = (await complete(stub_for(reference), greedy_ids_request(prompt, 20))).token_ids
    for stop_at in (0, 3, 7):
        request = greedy_ids_request(prompt, 20)
        request.stopping.stop_token_ids.append(expected[stop_at])
        result = await complete(stub_for(server), request)
        assert result.token_ids == expected[:expected.index(expected[stop_at]) + 1]
        assert result.finish_reason == generate_pb2.FINISH_REASON_STOP
    result = await complete(stub_for(server), greedy_ids_request(prompt, 5))
    assert result.token_ids == expected[:5] and result.usage.completion_tokens == 5
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def assert_an_abort_in_flight_frees_every_block(server, prompt: list[int],
                                                      request_id: str) -> None:
    """An abort after a few tokens ends the stream CANCELLED, frees every block, and the server
    still serves."""
    stub = stub_for(server)
    call = stub.Generate(greedy_ids_request(prompt, 200, request_id=request_id))
    seen = 0
    async for chunk in call:
        seen += len(chunk.token_ids)
        if seen >= 3:
            await stub.Abort(generate_pb2.AbortRequest(request_id=request_id))
            break
    chunks = [c async for c in call]
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_CANCELLED
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)
    assert len((await complete(stub, greedy_ids_request(prompt[:7], 4))).token_ids) == 4


@dataclasses.dataclass
class SseStream:
    """A streamed HTTP response as its client read it: the head's headers, the `data:` payloads
    in order, and the body's framing (its HTTP chunks, or None where it was not chunked)."""

    headers: dict[str, str]
    events: list[str]
    num_http_chunks: int | None

    def text(self) -> str:
        """The completion's text: every choice's text (or chat delta content) joined."""
        parts = []
        for event in self.events:
            if event == "[DONE]":
                continue
            for choice in json.loads(event)["choices"]:
                parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        return "".join(parts)


def http_json(port: int, path: str, body: dict | None = None,
              timeout_s: float = 60) -> tuple[int, object]:
    """GET `path` (POST `body` as JSON when given) on 127.0.0.1: the status and the JSON answer,
    an error's too. Blocking: from a test's loop, call it with asyncio.to_thread."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


async def sse_request(port: int, path: str, body: dict, http_version: str = "1.1",
                      receive_buffer: int = 0, pause_s: float = 0.0) -> SseStream:
    """POSTs `body` with a raw HTTP client and reads the streamed answer to its end.
    receive_buffer: the socket's SO_RCVBUF (0: the kernel's); pause_s: a sleep after the first
    chunk, as a client that stops reading for a while."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/{http_version}\r\nhost: 127.0.0.1\r\n"
                 f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
                 .encode() + payload)
    status = await reader.readline()
    assert status.split()[1] == b"200", status
    headers = {}
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body_bytes, num_chunks = b"", None
    if headers.get("transfer-encoding") == "chunked":
        num_chunks = 0
        while size := int((await reader.readline()).strip(), 16):
            body_bytes += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
            num_chunks += 1
            if num_chunks == 1 and pause_s:
                await asyncio.sleep(pause_s)
        assert await reader.readexactly(2) == b"\r\n"
    else:
        body_bytes = await reader.read()
    writer.close()
    events = [e[len("data: "):] for e in body_bytes.decode().split("\n\n") if e]
    return SseStream(headers, events, num_chunks)


# Health and progress, for tests that break things while requests run.

async def health_status(server) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
    return reply.status


async def wait_for_health(server, status: int, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await health_status(server) != status:
        assert asyncio.get_running_loop().time() < deadline, f"health never became {status}"
        await asyncio.sleep(0.02)


async def stream_tokens(stub, request, token_lists: list[list[int]], index: int):
    """One request's chunks; its tokens land in token_lists[index] as they come (so that a
    test sees its progress)."""
    chunks = []
    async for chunk in stub.Generate(request):
        chunks.append(chunk)
        token_lists[index].extend(chunk.token_ids)
    return chunks


async def assert_finished_as_undisturbed(server, tasks, reference, streamed,
                                         recoveries: int = 1) -> None:
    """The streams `tasks` (stream_tokens into `streamed`) all end with LENGTH and exactly the
    reference run's tokens, after `recoveries` recoveries of the engine; then nothing is left
    in flight and no block leaked."""
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    for chunks, ref, tokens in zip(results, reference, streamed):
        assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert tokens == ref.token_ids
    assert server.loop.num_engine_recoveries == recoveries
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


def child_pids(pid: int) -> list[int]:
    """The process ids of a process's children (Linux)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]
