"""Soak: many requests of random lengths through a real scheduler process and a real model
service, with random client cancels, Aborts, deadlines and parallel samples, a small KV cache
(so that preemption happens) and one SIGKILL of the model service (restarted on the same port)
in the middle. Afterwards every request ended with a final chunk or a status, greedy outputs are
exact (no token lost or repeated across the kill), no KV block is leaked, and the scheduler's
resident memory did not grow after warm-up.

CI runs the null model (thousands of requests) and a shorter run on the tiny model. A longer run:
    PLANSERVE_SOAK_REQUESTS=50000 PYTHONPATH=protos:.:tests \\
        python -m pytest tests/e2e/test_soak.py -m slow -k null
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import subprocess
import sys
from collections import Counter

import grpc
import pytest

from api import greedy_ids_request
from conftest import EngineProcess
from model_service.models.null import null_continuation
from planserve.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.slow(
    reason="thousands of requests through a scheduler process and a model service, one killed and "
    "restarted mid-run"
)

PORT_LINE = "PLANSERVE_PORT="
# Statuses a request may end with here, and why: the client cancelled it, or its gRPC deadline.
EXPECTED_STATUSES = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclasses.dataclass
class Plan:
    """What the soak does with one request."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    action: str  # complete | cancel | abort | deadline | grpc-deadline | samples
    cancel_after_chunks: int = 0


@dataclasses.dataclass
class Outcome:
    finals: int = 0  # chunks with a finish reason (one per sample)
    reasons: tuple = ()
    status: grpc.StatusCode | None = None
    tokens: dict = dataclasses.field(default_factory=dict)  # sample index -> token ids


def _plans(rng: random.Random, count: int, max_prompt: int, max_new: int) -> list[Plan]:
    actions = ["complete"] * 70 + ["cancel"] * 8 + ["abort"] * 7 + ["deadline"] * 5 + \
        ["grpc-deadline"] * 5 + ["samples"] * 5
    return [Plan(f"soak-{i}", [rng.randrange(256) for _ in range(rng.randint(1, max_prompt))],
                 rng.randint(1, max_new), rng.choice(actions), rng.randint(0, 4))
            for i in range(count)]


async def _run(stub, plan: Plan) -> Outcome:
    request = greedy_ids_request(plan.prompt, plan.max_new_tokens, request_id=plan.request_id)
    timeout = None
    if plan.action == "deadline":
        request.deadline_ms = 1 + plan.cancel_after_chunks * 5
    elif plan.action == "grpc-deadline":
        timeout = 0.01 + plan.cancel_after_chunks * 0.02
    elif plan.action == "samples":
        request.n = 2
    outcome = Outcome()
    call = stub.Generate(request, timeout=timeout)
    num_chunks = 0
    try:
        while (chunk := await call.read()) is not grpc.aio.EOF:
            num_chunks += 1
            outcome.tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
            if chunk.finish_reason:
                outcome.finals += 1
                outcome.reasons += (chunk.finish_reason,)
            if plan.action == "cancel" and num_chunks > plan.cancel_after_chunks:
                call.cancel()
            if plan.action == "abort" and num_chunks == 1 + plan.cancel_after_chunks:
                try:
                    await stub.Abort(generate_pb2.AbortRequest(request_id=plan.request_id))
                except grpc.aio.AioRpcError as error:  # it may have finished already
                    assert error.code() == grpc.StatusCode.NOT_FOUND, error
    except grpc.aio.AioRpcError as error:
        outcome.status = error.code()
    except asyncio.CancelledError:
        outcome.status = grpc.StatusCode.CANCELLED
    return outcome


def _check(plan: Plan, outcome: Outcome, exact) -> None:
    samples = 2 if plan.action == "samples" else 1
    if outcome.status is not None:  # ended with a status, which must be one we asked for
        assert outcome.status in EXPECTED_STATUSES, (plan, outcome.status)
        assert (plan.action, outcome.status) in (
            ("cancel", grpc.StatusCode.CANCELLED),
            ("grpc-deadline", grpc.StatusCode.DEADLINE_EXCEEDED)), (plan, outcome.status)
        return
    assert outcome.finals == samples, (plan, outcome)  # ...or with a final chunk per sample
    if plan.action in ("complete", "samples"):
        assert set(outcome.reasons) == {generate_pb2.FINISH_REASON_LENGTH}, (plan, outcome)
        for tokens in outcome.tokens.values():
            assert len(tokens) == plan.max_new_tokens, plan
            if exact is not None:
                assert tokens == exact(plan), plan


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def _idle_status(stub, timeout_s: float = 60.0) -> generate_pb2.GetServerStatusResponse:
    """GetServerStatus once nothing waits or runs (aborts apply at the next step)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status = await stub.GetServerStatus(generate_pb2.GetServerStatusRequest(), timeout=10)
        if (status.num_waiting == 0 and status.num_running == 0
                and status.num_free_kv_blocks == status.num_kv_blocks):
            return status
        assert asyncio.get_running_loop().time() < deadline, f"never idle: {status}"
        await asyncio.sleep(0.05)


async def soak(engine_args: tuple, num_requests: int, concurrency: int, max_prompt: int,
               max_new: int, exact, seed: int = 1234) -> Counter:
    rng = random.Random(seed)
    plans = _plans(rng, num_requests, max_prompt, max_new)
    engine = EngineProcess(*engine_args)
    engine_port = engine.address.rsplit(":", 1)[1]
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service.cli", "--log-level", "warning", "scheduler",
         "--engine", engine.address, "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
         "--max-num-seqs", str(concurrency), "--max-num-batched-tokens", "512",
         "--max-queue-len", str(num_requests)],
        stdout=subprocess.PIPE, text=True)
    try:
        for line in scheduler.stdout:
            if line.startswith(PORT_LINE):
                port = int(line[len(PORT_LINE):])
                break
        else:
            raise AssertionError(f"scheduler exited with {scheduler.wait()}")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        outcomes: dict[str, Outcome] = {}
        gate = asyncio.Semaphore(concurrency)

        async def one(plan: Plan) -> None:
            async with gate:
                outcomes[plan.request_id] = await _run(stub, plan)

        async def phase(chunk: list[Plan]) -> None:
            await asyncio.gather(*(one(p) for p in chunk))

        quarter = num_requests // 4
        await phase(plans[:quarter])  # warm-up
        await _idle_status(stub)
        rss_warm = _rss_bytes(scheduler.pid)

        # The middle half, with the model service killed once while it is busy.
        middle = asyncio.ensure_future(phase(plans[quarter:3 * quarter]))
        while len(outcomes) < 2 * quarter and not middle.done():
            await asyncio.sleep(0.01)
        assert not middle.done(), "the middle phase ended before the kill"
        engine.process.send_signal(signal.SIGKILL)
        engine.process.wait()
        engine = EngineProcess(*engine_args, "--port", engine_port)
        await middle

        await phase(plans[3 * quarter:])
        status = await _idle_status(stub)
        rss_end = _rss_bytes(scheduler.pid)
        await channel.close()

        assert len(outcomes) == num_requests
        for plan in plans:
            _check(plan, outcomes[plan.request_id], exact)
        assert status.num_free_kv_blocks == status.num_kv_blocks  # no block leaked
        # Resident memory after warm-up stays put (a per-request leak of a few KiB would show
        # over thousands of requests; allocator noise stays well below this).
        print(f"soak: {num_requests} requests, scheduler RSS after warm-up {rss_warm >> 20} MiB, "
              f"at the end {rss_end >> 20} MiB")
        assert rss_end - rss_warm < 48 << 20, (rss_warm, rss_end)
        assert scheduler.poll() is None
        scheduler.send_signal(signal.SIGTERM)
        assert await asyncio.get_running_loop().run_in_executor(None, scheduler.wait, 60) == 0
        return Counter(plan.action if outcomes[plan.request_id].status is None
                       else f"{plan.action}:{outcomes[plan.request_id].status.name}"
                       for plan in plans)
    finally:
        if scheduler.poll() is None:
            scheduler.kill()
        engine.stop()


async def test_soak_null_model_thousands_of_requests_one_engine_kill():
    num_requests = int(os.environ.get("PLANSERVE_SOAK_REQUESTS", "2000"))
    counts = await soak(("--model", "null", "--num-kv-blocks", "256"), num_requests,
                        concurrency=48, max_prompt=200, max_new=64,
                        exact=lambda plan: null_continuation(plan.prompt,
                                                             plan.max_new_tokens))
    print(dict(counts))
    assert counts["complete"] > num_requests // 2, counts


async def test_soak_tiny_model_shorter_run_one_engine_kill():
    counts = await soak(("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64"),
                        240, concurrency=16, max_prompt=80, max_new=24, exact=None)
    print(dict(counts))
    assert counts["complete"] > 100, counts
