"""`planserve serve --frontend-processes 2`: the doors in two frontend processes sharing the
ports, the scheduler loop alone in the engine core. Real processes on 127.0.0.1, the null model
(its tokens depend on each prompt, so a token crossing streams would show): every stream gets
exactly its own tokens through either frontend, HTTP SSE through the same port, a cancel frees
its request, Abort finds a request of either frontend, a frontend killed ends only its own
streams, the core killed ends the frontends, SIGTERM drains; no KV block leaks. The cases with
the core in this process are in test_frontend_processes_doors.py."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from api import greedy_ids_request
from model_service.models.null import null_continuation
from planserve.v1 import generate_pb2, generate_pb2_grpc

NUM_STREAMS = 256
NUM_TOKENS = 40
# Connections the streams are spread over: the kernel gives each to one frontend (SO_REUSEPORT
# hashes the client's address), so with 16 both frontends get some.
NUM_CHANNELS = 16


def _prompt(i: int) -> list[int]:
    """Prompts whose continuations all differ: length and last token differ modulo 26."""
    return [7] * (4 + i % 26) + [32 + i // 26]


class Served:
    """`python -m tools serve --model null --frontend-processes 2` and its frontend pids."""

    def __init__(self, delay_ms: int = 2, drain_grace_s: float = 30.0):
        self.log = tempfile.TemporaryFile(mode="w+")  # every process's stderr (JSON lines)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tools", "serve", "--model", "null",
             "--null-step-delay-ms", str(delay_ms), "--frontend-processes", "2",
             "--port", "0", "--engine-port", "0", "--http-port", "0", "--metrics-port", "-1",
             "--max-num-seqs", str(NUM_STREAMS), "--max-num-slots", str(NUM_STREAMS),
             "--max-queue-len", str(4 * NUM_STREAMS), "--max-num-batched-tokens", "4096",
             "--drain-grace-seconds", str(drain_grace_s)],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=dict(os.environ, PLANSERVE_LOG_JSON="1"))
        ports = {}
        for line in self.process.stdout:
            key, _, value = line.strip().partition("=")
            if key in ("PLANSERVE_PORT", "PLANSERVE_HTTP_PORT"):
                ports[key] = int(value)
            if len(ports) == 2:
                break
        else:
            raise RuntimeError(f"planserve serve exited with {self.process.wait()}")
        self.address = f"127.0.0.1:{ports['PLANSERVE_PORT']}"
        self.http_port = ports["PLANSERVE_HTTP_PORT"]
        self.frontends = _frontend_pids(self.process.pid)
        assert len(self.frontends) == 2

    def channels(self, n: int = NUM_CHANNELS) -> list[grpc.aio.Channel]:
        """n channels, each its own connection (no shared subchannel)."""
        return [grpc.aio.insecure_channel(self.address,
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(n)]

    def log_events(self, event: str) -> list[dict]:
        """The log lines of `event` every process of the server wrote so far (whole lines: a
        process may be writing one as this reads)."""
        self.log.seek(0)
        return [json.loads(line) for line in self.log
                if f'"event": "{event}"' in line and line.endswith("\n")]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=10) as r:
            return r.read().decode()

    async def wait_exit(self) -> int:
        return await asyncio.get_running_loop().run_in_executor(None, self.process.wait, 60)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _frontend_pids(root: int) -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{root}/task"):
        with open(f"/proc/{root}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                with open(f"/proc/{child}/cmdline") as cmd:
                    if "scheduler_service.frontends" in cmd.read():
                        pids.append(child)
    return pids


async def _status(address: str) -> generate_pb2.GetServerStatusResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        return await stub.GetServerStatus(generate_pb2.GetServerStatusRequest(), timeout=10)


async def _until_idle_and_all_blocks_free(address: str, timeout_s: float = 30.0) -> None:
    """The core's snapshot reaches the frontends every step and every 0.2 s while idle."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status = await _status(address)
        if (not status.num_running and not status.num_waiting
                and status.num_free_kv_blocks == status.num_kv_blocks):
            return
        assert asyncio.get_running_loop().time() < deadline, f"never idle: {status}"
        await asyncio.sleep(0.05)


async def _read(stub, i: int, num_tokens: int = NUM_TOKENS, tag: str = "fe") -> list[int]:
    ids, reason = [], 0
    async for chunk in stub.Generate(greedy_ids_request(_prompt(i), num_tokens,
                                                        request_id=f"{tag}-{i}")):
        assert chunk.request_id == f"{tag}-{i}"
        ids.extend(chunk.token_ids)
        reason = chunk.finish_reason or reason
    assert reason == generate_pb2.FINISH_REASON_LENGTH, (i, len(ids), reason)
    return ids


@pytest.fixture(scope="module")
def served():
    served = Served()
    yield served
    served.stop()


def test_every_process_froze_its_start_up_heap(served):
    """The engine core, each frontend and the model service froze what start-up made once
    serving (scheduler_service/heap.py): a full collection no longer walks it."""
    deadline = time.monotonic() + 30  # the core freezes after it printed its ports
    frozen = served.log_events("startup_heap_frozen")
    while len(frozen) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
        frozen = served.log_events("startup_heap_frozen")
    by_process = sorted((e["process"], e.get("frontend")) for e in frozen)
    assert by_process == [("frontend", 0), ("frontend", 1), ("model_service", None),
                          ("scheduler", None)], frozen
    assert all(e["objects"] > 0 for e in frozen), frozen


def _added_per_frontend(metrics: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^planserve_frontend_requests_total\{frontend="(\d+)"\} (\S+)$', metrics, re.M)}


async def test_256_streams_through_two_frontends_each_get_exactly_their_own_tokens(served):
    before = _added_per_frontend(served.metrics())
    channels = served.channels()
    try:
        stubs = [generate_pb2_grpc.GenerationServiceStub(c) for c in channels]
        done = await asyncio.gather(*(_read(stubs[i % NUM_CHANNELS], i)
                                      for i in range(NUM_STREAMS)))
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    for i, ids in enumerate(done):
        assert ids == null_continuation(_prompt(i), NUM_TOKENS), i
    added = _added_per_frontend(served.metrics())
    counts = {k: added[k] - before.get(k, 0) for k in added}
    assert sorted(counts) == ["0", "1"] and all(counts.values()), counts
    assert sum(counts.values()) == NUM_STREAMS
    await _until_idle_and_all_blocks_free(served.address)


def _sse_text(port: int, prompt: list[int], max_tokens: int, **extra) -> tuple[str, str]:
    """The streamed text of a completion (sample 0's when n > 1) and its finish reason."""
    body = json.dumps({"model": "null", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True, **extra}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    text: dict[int, list[str]] = {}
    reason = ""
    with urllib.request.urlopen(request, timeout=30) as response:
        for line in response:
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.setdefault(choice["index"], []).append(choice["text"])
                reason = choice["finish_reason"] or reason
    assert sorted(text) == list(range(extra.get("n", 1)))
    return "".join(text[0]), reason


async def test_http_sse_streams_through_the_same_ports(served):
    loop = asyncio.get_running_loop()
    results = await asyncio.gather(*(loop.run_in_executor(
        None, _sse_text, served.http_port, _prompt(i), 20) for i in range(8)))
    for i, (text, reason) in enumerate(results):
        assert text == bytes(null_continuation(_prompt(i), 20)).decode()
        assert reason == "length"
    await _until_idle_and_all_blocks_free(served.address)


async def test_text_made_by_a_frontend_or_by_the_core_is_the_tokens_text(served):
    """Without stop strings a request's text is made by its frontend (the core sends ids); with
    them, by the core (frontends/text.py): either way it is the tokens' text, cut before a stop;
    n=2 samples each get theirs."""
    loop = asyncio.get_running_loop()
    full = [bytes(null_continuation(_prompt(i), 20)).decode() for i in range(6)]
    stops = [text[8:10] for text in full]
    plain, stopped, two = await asyncio.gather(
        asyncio.gather(*(loop.run_in_executor(None, _sse_text, served.http_port, _prompt(i), 20)
                         for i in range(6))),
        asyncio.gather(*(loop.run_in_executor(None, lambda i=i: _sse_text(
            served.http_port, _prompt(i), 20, stop=[stops[i]])) for i in range(6))),
        loop.run_in_executor(None, lambda: _sse_text(served.http_port, _prompt(0), 20, n=2)),
    )
    for i in range(6):
        assert plain[i] == (full[i], "length"), i
        assert stopped[i] == (full[i][: full[i].find(stops[i])], "stop"), i
    assert two == (full[0], "length")  # and sample 1 streamed too (the helper checks)
    await _until_idle_and_all_blocks_free(served.address)


async def test_a_client_cancel_frees_its_request(served):
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        call = stub.Generate(greedy_ids_request(_prompt(3), 5000, request_id="cancelled"))
        first = await call.read()
        assert first.token_ids
        assert (await _status(served.address)).num_running == 1
        call.cancel()
    await _until_idle_and_all_blocks_free(served.address)


async def _outcome(stub, i: int, num_tokens: int):
    try:
        return await _read(stub, i, num_tokens, tag="kill")
    except grpc.aio.AioRpcError as error:
        return error


async def test_a_killed_frontend_ends_only_its_own_streams_and_nothing_leaks():
    served = Served(delay_ms=5)
    channels = served.channels()
    try:
        stubs = [generate_pb2_grpc.GenerationServiceStub(c) for c in channels]
        num_tokens = 400  # two seconds at least at 5 ms a step
        streams = [asyncio.ensure_future(_outcome(stubs[i % NUM_CHANNELS], i, num_tokens))
                   for i in range(64)]
        deadline = asyncio.get_running_loop().time() + 30
        while (await _status(served.address)).num_running < 64:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        os.kill(served.frontends[0], signal.SIGKILL)
        outcomes = await asyncio.gather(*streams)
        failed = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        finished = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, list)]
        assert failed and finished, (len(failed), len(finished))
        for i, ids in finished:
            assert ids == null_continuation(_prompt(i), num_tokens), i
        await _until_idle_and_all_blocks_free(served.address)
    finally:
        await asyncio.gather(*(c.close() for c in channels))
        served.stop()


async def test_sigterm_drains_through_the_frontends_and_exits_0():
    served = Served(delay_ms=10)
    try:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="")
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
            running = stub.Generate(greedy_ids_request(_prompt(1), 200, request_id="drained"))
            ids = list((await running.read()).token_ids)
            served.process.send_signal(signal.SIGTERM)
            while (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(greedy_ids_request(_prompt(2), 5)).read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            while (chunk := await running.read()) is not grpc.aio.EOF:
                ids.extend(chunk.token_ids)
            assert ids == null_continuation(_prompt(1), 200)
        assert await served.wait_exit() == 0
        for pid in served.frontends:
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
    finally:
        served.stop()


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_taken_door_port_is_one_line_naming_its_flag(held_port, flag):
    """The doors' ports are resolved and held by the core before anything starts: another
    listener is refused, never silently shared."""
    ports = {"--port": "0", "--engine-port": "0", "--http-port": "0", "--metrics-port": "-1",
             flag: str(held_port)}
    result = subprocess.run(
        [sys.executable, "-m", "tools", "serve", "--model", "null", "--frontend-processes", "2",
         *[a for pair in ports.items() for a in pair]],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"planserve: {flag} {held_port}: "), lines



def _model_service_pid(root: int) -> int:
    for task in os.listdir(f"/proc/{root}/task"):
        with open(f"/proc/{root}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                with open(f"/proc/{child}/cmdline") as cmd:
                    if "model_service" in cmd.read():
                        return child
    raise AssertionError("no model service child")


async def test_the_frontends_end_their_streams_and_exit_when_the_core_dies():
    served = Served(delay_ms=10)
    model_service = _model_service_pid(served.process.pid)
    try:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)
            running = stub.Generate(greedy_ids_request(_prompt(1), 1000, request_id="orphan"))
            assert (await running.read()).token_ids
            served.process.kill()
            last = None
            try:
                while (chunk := await running.read()) is not grpc.aio.EOF:
                    last = chunk
                ended_with = last.finish_reason if last is not None else None
            except grpc.aio.AioRpcError:
                ended_with = "rpc error"
            assert ended_with in (generate_pb2.FINISH_REASON_ERROR, "rpc error")
        deadline = asyncio.get_running_loop().time() + 30
        while any(os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)
                  for pid in served.frontends):
            assert asyncio.get_running_loop().time() < deadline, "a frontend outlived the core"
            await asyncio.sleep(0.05)
    finally:
        os.kill(model_service, signal.SIGKILL)
        served.stop()




async def test_abort_on_any_connection_finds_a_request_of_either_frontend(served):
    """Fifteen streams on one connection, each aborted on another connection: the kernel puts
    some of those on the other frontend, whose Abort the core answers."""
    channels = served.channels()
    try:
        stubs = [generate_pb2_grpc.GenerationServiceStub(c) for c in channels]
        calls = [stubs[0].Generate(greedy_ids_request(_prompt(i), 5000, request_id=f"ab-{i}"))
                 for i in range(1, NUM_CHANNELS)]
        for call in calls:
            assert (await call.read()).token_ids
        for i in range(1, NUM_CHANNELS):
            await stubs[i].Abort(generate_pb2.AbortRequest(request_id=f"ab-{i}"), timeout=10)
        for call in calls:
            reason = None
            while (chunk := await call.read()) is not grpc.aio.EOF:
                reason = chunk.finish_reason or reason
            assert reason == generate_pb2.FINISH_REASON_CANCELLED
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stubs[1].Abort(generate_pb2.AbortRequest(request_id="ab-none"), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    await _until_idle_and_all_blocks_free(served.address)
