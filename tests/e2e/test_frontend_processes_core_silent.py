"""`planserve serve --frontend-processes 2` with its engine core stopped (SIGSTOP), as a core
whose loop is stuck: the frontends, which used to go on saying SERVING on the core's last
snapshot, say NOT_SERVING once it has been silent CORE_SILENT_S (so readiness takes the pod out
and a liveness probe may restart it); continued, the core speaks again, health comes back and a
request is served."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from planserve.v1 import generate_pb2_grpc
from scheduler_service.frontends.process import CORE_SILENT_S
from test_frontend_processes import Served, _model_service_pid, _read

SERVING = health_pb2.HealthCheckResponse.SERVING


async def _until_health(address: str, serving: bool, timeout_s: float) -> float:
    """Seconds until a health check on a new connection says `serving` (either frontend)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
        if (reply.status == SERVING) == serving:
            return loop.time() - start
        assert loop.time() - start < timeout_s, f"health never became serving={serving}"
        await asyncio.sleep(0.2)


async def test_a_silent_core_turns_the_frontends_health_to_not_serving_until_it_speaks():
    served = Served(delay_ms=2)
    model_service = _model_service_pid(served.process.pid)
    try:
        await _until_health(served.address, serving=True, timeout_s=30)
        served.process.send_signal(signal.SIGSTOP)
        try:
            waited_s = await _until_health(served.address, serving=False,
                                           timeout_s=CORE_SILENT_S + 10)
            assert waited_s > CORE_SILENT_S / 2  # the silence, not something else, did it
            events = served.log_events("engine_core_silent")
            assert events and all(e["silent_s"] >= CORE_SILENT_S for e in events)
        finally:
            served.process.send_signal(signal.SIGCONT)
        await _until_health(served.address, serving=True, timeout_s=60)
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)
            assert len(await _read(stub, 3, num_tokens=8, tag="silent")) == 8  # and LENGTH
    finally:
        served.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(model_service, signal.SIGKILL)
