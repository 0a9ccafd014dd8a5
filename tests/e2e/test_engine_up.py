"""planserve_engine_up is 0 until the model service has computed a step, then 1.

A real scheduler starts with its /metrics endpoint while no model service listens at its engine
address; the gauge reads 0 (the scheduler is waiting in Describe). A real model service then
starts on that port; once the scheduler's readiness probe (a one-token step) has run, it reads 1.
"""
from __future__ import annotations

import asyncio
import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from api import complete, greedy_ids_request, stub_for
from conftest import EngineProcess
from scheduler_service.config import SchedulerConfig
from scheduler_service.server import SchedulerServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    """The unlabelled samples /metrics serves, by name (over HTTP, as Prometheus reads them)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.labels}


async def test_engine_up_is_zero_until_the_first_step_then_one():
    engine_port = _free_port()
    server = SchedulerServer(SchedulerConfig(port=0, metrics_port=0,
                                             engine_address=f"127.0.0.1:{engine_port}"))
    engine = None
    await server.start()
    try:
        assert _scrape(server.metrics_port)["planserve_engine_up"] == 0
        connecting = asyncio.ensure_future(server.connect_engine())
        await asyncio.sleep(0.5)  # the scheduler is now waiting for Describe, with no engine
        assert not connecting.done()
        assert _scrape(server.metrics_port)["planserve_engine_up"] == 0
        engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "32",
                               "--port", str(engine_port))
        await connecting
        samples = _scrape(server.metrics_port)
        assert samples["planserve_engine_up"] == 1
        assert samples["planserve_engine_recoveries_total"] == 0  # a first start, no recovery
        reply = await complete(stub_for(server), greedy_ids_request([5, 6, 7], 3))
        assert len(reply.token_ids) == 3
        assert _scrape(server.metrics_port)["planserve_engine_up"] == 1
    finally:
        await server.stop(grace_s=1)
        if engine is not None:
            engine.stop()
