"""The link's keepalive (planserve/contract.py keepalive_options) on real servers: a peer whose
host is lost closes nothing, so neither end hears of it but by pinging. Between the two services
sits a proxy that can go silent (tests/silent_proxy.py): it then holds its connections open and
passes nothing, as a lost host's would. Without the keepalive, the model service holds the lost
scheduler's Execute stream (and refuses every other) and the scheduler waits on its lost model
service's stream, each for as long as the socket stays open."""

import asyncio

from grpc_health.v1 import health_pb2

from api import (assert_finished_as_undisturbed, complete, greedy_ids_request, stream_tokens,
                 stub_for, wait_for_health)
from conftest import start_scheduler
from silent_proxy import SilentProxy

KEEPALIVE_S = 0.5  # both ends; a lost peer is noticed within about two of these


async def _model_service():
    from model_service.config import ModelServiceConfig
    from model_service.server import serve

    return await serve(ModelServiceConfig(model="tiny", dtype="float32", port=0, num_kv_blocks=64,
                                          scheduler_keepalive_s=KEEPALIVE_S))


async def test_a_scheduler_lost_without_a_word_frees_the_model_service_for_the_next():
    from model_service.server import shutdown

    engine = await _model_service()
    proxy = SilentProxy(engine.bound_port)
    lost = await start_scheduler(f"127.0.0.1:{await proxy.start()}")
    after_it = None
    try:
        request = greedy_ids_request([5, 6, 7, 8], 8)
        before = await complete(stub_for(lost), request)
        proxy.go_silent()
        after_it = await start_scheduler(f"127.0.0.1:{engine.bound_port}")
        await wait_for_health(after_it, health_pb2.HealthCheckResponse.SERVING, timeout_s=30)
        again = await complete(stub_for(after_it), request)
        assert again.token_ids == before.token_ids
    finally:
        for server in (lost, after_it):
            if server is not None:
                await server.stop(grace_s=1)
        await proxy.close()
        await shutdown(engine, grace_s=1)


async def test_a_model_service_lost_mid_generation_is_replaced_and_requests_finish():
    """The address now leads to another model service (as a Service's name to a rescheduled
    pod): the scheduler notices the lost one, connects to the new one, and the requests in
    flight finish there with the undisturbed run's greedy tokens."""
    from model_service.server import shutdown

    first, second = await _model_service(), await _model_service()
    proxy = SilentProxy(first.bound_port)
    server = await start_scheduler(f"127.0.0.1:{await proxy.start()}",
                                   engine_keepalive_s=KEEPALIVE_S)
    try:
        stub = stub_for(server)
        requests = [greedy_ids_request([17, 4000, 1203, 88], 120), greedy_ids_request([7] * 30, 90)]
        reference = [await complete(stub, r) for r in requests]
        streamed: list[list[int]] = [[] for _ in requests]
        tasks = [asyncio.ensure_future(stream_tokens(stub, r, streamed, i)) for i, r in enumerate(requests)]
        while min(len(t) for t in streamed) < 5:
            await asyncio.sleep(0.005)
        proxy.go_silent(next_target=second.bound_port)
        await assert_finished_as_undisturbed(server, tasks, reference, streamed)
    finally:
        await server.stop(grace_s=1)
        await proxy.close()
        for engine in (first, second):
            await shutdown(engine, grace_s=1)
