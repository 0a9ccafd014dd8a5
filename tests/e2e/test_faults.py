"""Faults on real processes: the model service is killed with SIGKILL mid-generation and started
again on the same port. Requests in flight see a delay, never an error nor a token twice, and
their greedy output is the undisturbed run's; health says NOT_SERVING while the engine is down."""
from __future__ import annotations

import asyncio
import signal

from grpc_health.v1 import health_pb2

from api import (assert_finished_as_undisturbed, assert_no_leaked_blocks, complete,
                 greedy_ids_request, health_status, stream_tokens, stub_for, wait_for_health,
                 wait_until_idle)
from conftest import EngineProcess, start_scheduler
from planserve.v1 import generate_pb2

ENGINE_ARGS = ("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
PROMPTS = [[17, 4000, 1203, 88, 9, 3141, 59, 26], list(range(5, 60)), [7, 7, 7, 7, 1, 2, 3]]
MAX_NEW_TOKENS = [300, 200, 250]


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def test_sigkill_of_the_model_service_mid_generation_loses_nothing():
    engine = EngineProcess(*ENGINE_ARGS)
    server = await start_scheduler(engine.address, max_num_batched_tokens=64, max_num_seqs=16)
    try:
        stub = stub_for(server)
        requests = [greedy_ids_request(p, n) for p, n in zip(PROMPTS, MAX_NEW_TOKENS)]
        reference = [await complete(stub, r) for r in requests]
        assert await health_status(server) == health_pb2.HealthCheckResponse.SERVING

        streamed: list[list[int]] = [[] for _ in requests]
        tasks = [asyncio.ensure_future(stream_tokens(stub, r, streamed, i))
                 for i, r in enumerate(requests)]
        while min(len(t) for t in streamed) < 10:  # every request has streamed some tokens
            await asyncio.sleep(0.005)
        engine.process.send_signal(signal.SIGKILL)
        engine.process.wait()
        tokens_at_kill = [len(t) for t in streamed]
        assert any(n < m for n, m in zip(tokens_at_kill, MAX_NEW_TOKENS)), \
            "every request finished before the kill: nothing was tested"

        await wait_for_health(server, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not all(t.done() for t in tasks)  # clients wait; nobody got an error
        engine = EngineProcess(*ENGINE_ARGS, "--port", str(_port_of(server.config.engine_address)))
        results = await asyncio.gather(*tasks)

        for chunks, ref, tokens in zip(results, reference, streamed):
            assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert tokens == ref.token_ids  # identical greedy output, no token twice
            assert "".join(c.text for c in chunks) == ref.text
        assert server.loop.num_engine_recoveries == 1
        registry = server.metrics.registry
        assert registry.get_sample_value("planserve_engine_recoveries_total") == 1
        assert registry.get_sample_value("planserve_engine_up") == 1
        await wait_for_health(server, health_pb2.HealthCheckResponse.SERVING)
        await wait_until_idle(server)
        assert_no_leaked_blocks(server)
        # And the restarted engine serves new requests as before.
        again = await complete(stub, requests[0])
        assert again.token_ids == reference[0].token_ids
    finally:
        await server.stop(grace_s=1)
        engine.stop()


async def test_idle_scheduler_notices_a_dead_model_service_and_comes_back():
    engine = EngineProcess(*ENGINE_ARGS)
    server = await start_scheduler(engine.address)
    try:
        stub = stub_for(server)
        before = await complete(stub, greedy_ids_request(PROMPTS[0], 8))
        engine.process.send_signal(signal.SIGKILL)
        engine.process.wait()
        await wait_for_health(server, health_pb2.HealthCheckResponse.NOT_SERVING)
        # A request sent while the engine is down waits instead of failing.
        waiting = asyncio.ensure_future(complete(stub, greedy_ids_request(PROMPTS[0], 8)))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        engine = EngineProcess(*ENGINE_ARGS, "--port", str(_port_of(server.config.engine_address)))
        await wait_for_health(server, health_pb2.HealthCheckResponse.SERVING)
        after = await waiting
        assert after.token_ids == before.token_ids
        await wait_until_idle(server)
        assert_no_leaked_blocks(server)
    finally:
        await server.stop(grace_s=1)
        engine.stop()


async def test_abort_while_the_model_service_is_down_ends_the_request():
    engine = EngineProcess(*ENGINE_ARGS)
    server = await start_scheduler(engine.address)
    try:
        stub = stub_for(server)
        streamed: list[list[int]] = [[]]
        request = greedy_ids_request(PROMPTS[1], 300, request_id="doomed")
        task = asyncio.ensure_future(stream_tokens(stub, request, streamed, 0))
        while len(streamed[0]) < 3:
            await asyncio.sleep(0.005)
        engine.process.send_signal(signal.SIGKILL)
        engine.process.wait()
        await wait_for_health(server, health_pb2.HealthCheckResponse.NOT_SERVING)
        await stub.Abort(generate_pb2.AbortRequest(request_id="doomed"))
        chunks = await task  # ends without the engine coming back
        assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_CANCELLED
        assert not server.loop.scheduler.requests
    finally:
        await server.stop(grace_s=1)
        engine.stop()


def _in_process_engine_config():
    """A model service in this process whose faults the tests inject into the model's forward:
    every step eager (cuda_graphs off), since a step replayed from CUDA graphs never calls it."""
    from model_service.config import ModelServiceConfig

    return ModelServiceConfig(model="tiny", dtype="float32", port=0, num_kv_blocks=64,
                              cuda_graphs="off")


async def test_readiness_needs_a_real_step_a_model_service_that_cannot_compute_is_not_ready():
    """The model service answers Describe and health, but its forward fails (as on a device
    error): the scheduler stays NOT_SERVING, requests wait; once the model computes again the
    scheduler turns SERVING on its own and serves them."""
    from model_service.server import serve, shutdown

    engine = await serve(_in_process_engine_config())
    model = engine.runner.model
    working_forward = model.forward

    def broken_forward(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    model.forward = broken_forward
    server = await start_scheduler(f"127.0.0.1:{engine.bound_port}")
    try:
        assert await health_status(server) == health_pb2.HealthCheckResponse.NOT_SERVING
        stub = stub_for(server)
        waiting = asyncio.ensure_future(complete(stub, greedy_ids_request(PROMPTS[0], 8)))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        assert await health_status(server) == health_pb2.HealthCheckResponse.NOT_SERVING
        model.forward = working_forward
        await wait_for_health(server, health_pb2.HealthCheckResponse.SERVING)
        served = await waiting
        assert len(served.token_ids) == 8
        assert served.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    finally:
        model.forward = working_forward
        await server.stop(grace_s=1)
        await shutdown(engine, grace_s=1)


async def test_a_request_the_model_service_keeps_failing_on_ends_with_an_error():
    """The model service passes its probe and computes every step that starts a sequence, but
    fails each step made of decodes alone (as a kernel bug in one kind of step would). Each
    recovery recomputes the sequences and streams one more token before the next failure, so
    "no progress since the last recovery" never holds: the requests end with ERROR once they
    have run through MAX_ENGINE_FAILURES_PER_REQUEST failures, instead of crawling a token per
    recovery. Their tokens so far are the undisturbed run's; nothing leaks; the same service,
    mended, serves again."""
    from model_service.server import serve, shutdown
    from scheduler_service.engine.loop import EngineLoop

    engine = await serve(_in_process_engine_config())
    model = engine.runner.model
    working_forward = model.forward
    server = await start_scheduler(f"127.0.0.1:{engine.bound_port}")
    try:
        stub = stub_for(server)
        requests = [greedy_ids_request(p, 60) for p in PROMPTS]
        reference = [await complete(stub, r) for r in requests]

        def forward_failing_decodes(input_ids, positions, *args, **kwargs):
            if int(positions.min()) > 0:  # no sequence starts in this step
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return working_forward(input_ids, positions, *args, **kwargs)

        model.forward = forward_failing_decodes
        streamed: list[list[int]] = [[] for _ in requests]
        results = await asyncio.wait_for(asyncio.gather(
            *(stream_tokens(stub, r, streamed, i) for i, r in enumerate(requests))), timeout=60)
        for chunks, ref, tokens in zip(results, reference, streamed):
            assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_ERROR
            # A token from each recompute, none twice, each the undisturbed run's.
            assert 0 < len(tokens) <= EngineLoop.MAX_ENGINE_FAILURES_PER_REQUEST + 2
            assert tokens == ref.token_ids[:len(tokens)]
        assert server.loop.num_engine_recoveries >= EngineLoop.MAX_ENGINE_FAILURES_PER_REQUEST
        await wait_until_idle(server)
        assert_no_leaked_blocks(server)

        model.forward = working_forward
        again = await asyncio.wait_for(complete(stub, requests[1]), timeout=60)
        assert again.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert again.token_ids == reference[1].token_ids
    finally:
        model.forward = working_forward
        await server.stop(grace_s=1)
        await shutdown(engine, grace_s=1)


async def test_a_plan_the_model_service_refuses_fails_the_requests_in_flight_and_no_later_one():
    """The model service refuses one plan (INVALID_ARGUMENT: a plan the scheduler should never
    have built, i.e. a bug). The requests in flight end with ERROR rather than being recomputed
    into the same refusal; the scheduler then reconnects and serves the next request as usual,
    where its engine loop used to stop for good, leaving every later request waiting."""
    from model_service.server import serve, shutdown
    from model_service.step.plan import PlanError

    engine = await serve(_in_process_engine_config())
    runner = engine.runner
    working_execute = runner.execute
    server = await start_scheduler(f"127.0.0.1:{engine.bound_port}")
    try:
        stub = stub_for(server)
        reference = await complete(stub, greedy_ids_request(PROMPTS[0], 20))

        def refuse_once(plan):
            runner.execute = working_execute
            raise PlanError("slots", "refused once by the test")

        runner.execute = refuse_once
        refused = await asyncio.wait_for(complete(stub, greedy_ids_request(PROMPTS[1], 20)), 30)
        assert refused.finish_reason == generate_pb2.FINISH_REASON_ERROR
        served = await asyncio.wait_for(complete(stub, greedy_ids_request(PROMPTS[0], 20)), 30)
        assert served.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert served.token_ids == reference.token_ids
        await wait_for_health(server, health_pb2.HealthCheckResponse.SERVING)
        await wait_until_idle(server)
        assert_no_leaked_blocks(server)
    finally:
        runner.execute = working_execute
        await server.stop(grace_s=1)
        await shutdown(engine, grace_s=1)


async def test_a_loop_that_fails_again_as_it_starts_over_backs_off_then_recovers():
    """The scheduler's own recovery fails (a fault injected into reset_engine) after a refused
    plan: each start-over meets it, and the loop backs off (0.1 s doubling) instead of spinning;
    once recovery works again the next request is served."""
    from model_service.server import serve, shutdown
    from model_service.step.plan import PlanError

    engine = await serve(_in_process_engine_config())
    runner = engine.runner
    working_execute = runner.execute
    server = await start_scheduler(f"127.0.0.1:{engine.bound_port}")
    scheduler = server.loop.scheduler
    working_reset = scheduler.reset_engine
    resets: list[float] = []
    try:
        def refuse_once(plan):
            runner.execute = working_execute
            raise PlanError("slots", "refused once by the test")

        def failing_reset(facts):
            resets.append(asyncio.get_running_loop().time())
            raise RuntimeError("reset_engine broken by the test")

        runner.execute, scheduler.reset_engine = refuse_once, failing_reset
        stub = stub_for(server)
        refused = await asyncio.wait_for(complete(stub, greedy_ids_request(PROMPTS[0], 8)), 30)
        assert refused.finish_reason == generate_pb2.FINISH_REASON_ERROR
        deadline = asyncio.get_running_loop().time() + 30
        while len(resets) < 4:
            assert asyncio.get_running_loop().time() < deadline, f"{len(resets)} start-overs"
            await asyncio.sleep(0.05)
        # The waits between start-overs double from 0.1 s (a sleep never ends early; a spin's
        # gaps are a few milliseconds).
        gaps = [b - a for a, b in zip(resets, resets[1:4])]
        assert gaps[0] > 0.099 and gaps[1] > 0.199 and gaps[2] > 0.399, gaps

        scheduler.reset_engine = working_reset
        served = await asyncio.wait_for(complete(stub, greedy_ids_request(PROMPTS[0], 8)), 30)
        assert served.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        await wait_until_idle(server)
        assert_no_leaked_blocks(server)
    finally:
        runner.execute, scheduler.reset_engine = working_execute, working_reset
        await server.stop(grace_s=1)
        await shutdown(engine, grace_s=1)


async def test_a_step_left_unanswered_is_given_up_on_and_its_requests_finish_after():
    """The model service's first decode-only step hangs, its connection still up (as a call
    holding Python's lock would leave it, where its own watchdog cannot run): past the
    scheduler's --engine-step-timeout-seconds the scheduler drops the stream and turns
    NOT_SERVING, where it used to wait for good. Once the step returns, the scheduler reconnects
    and the requests finish with the undisturbed run's greedy tokens."""
    import threading

    from model_service.server import serve, shutdown

    engine = await serve(_in_process_engine_config())
    model = engine.runner.model
    working_forward = model.forward
    release, hung = threading.Event(), threading.Event()
    server = await start_scheduler(f"127.0.0.1:{engine.bound_port}", engine_step_timeout_s=0.5)
    try:
        stub = stub_for(server)
        requests = [greedy_ids_request(p, 30) for p in PROMPTS[:2]]
        reference = [await complete(stub, r) for r in requests]

        def forward_hanging_once(input_ids, positions, *args, **kwargs):
            if int(positions.min()) > 0 and not hung.is_set():
                hung.set()
                release.wait(60)
            return working_forward(input_ids, positions, *args, **kwargs)

        model.forward = forward_hanging_once
        streamed: list[list[int]] = [[] for _ in requests]
        tasks = [asyncio.ensure_future(stream_tokens(stub, r, streamed, i))
                 for i, r in enumerate(requests)]
        await wait_for_health(server, health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s=20)
        assert hung.is_set() and not any(t.done() for t in tasks)
        release.set()
        await assert_finished_as_undisturbed(server, tasks, reference, streamed)
    finally:
        release.set()
        model.forward = working_forward
        await server.stop(grace_s=1)
        await shutdown(engine, grace_s=1)
