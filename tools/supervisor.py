"""`planserve serve`'s model service child: started, restarted whenever it dies, and killed when
it stops answering.

A child that dies is restarted on the same port (the scheduler notices, reconnects and
recomputes what was in flight); the delay before a restart doubles, up to MAX_DELAY_S, while the
child keeps dying within HEALTHY_S of its start. A child that is alive but no longer answers (a
call holding Python's lock, a stopped process) would otherwise stay so: the scheduler's own
timeouts drop its stream, but cannot end it. The liveness probe does what the deployment's
livenessProbe does for the model service's container (k8s/base/deployment.yaml): a gRPC health
check every period, each given half a period, and after FAILURES in a row the child is killed
and restarted as when it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Optional

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc

from scheduler_service.engine.client import says_serving

log = structlog.get_logger("planserve.cli")

ENGINE_PORT_LINE = "PLANSERVE_ENGINE_PORT="


async def start_model_service(argv: list[str]) -> tuple[asyncio.subprocess.Process, int]:
    """Starts the model service and waits for the line that tells its port."""
    child = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    stdout = child.stdout
    assert stdout is not None  # stdout=PIPE
    while True:
        line = await stdout.readline()
        if not line:
            await child.wait()
            raise RuntimeError(
                f"model service exited with status {child.returncode} before it started serving"
            )
        text = line.decode().strip()
        if text.startswith(ENGINE_PORT_LINE):
            return child, int(text[len(ENGINE_PORT_LINE) :])


class ModelServiceSupervisor:
    """The child, from `argv_for(port)` (port 0 at the first start: a free one)."""

    FIRST_DELAY_S = 0.5
    MAX_DELAY_S = 30.0
    HEALTHY_S = 60.0
    FAILURES = 3  # health checks failed in a row before the child is killed

    def __init__(self, argv_for: Callable[[int], list[str]], port: int, liveness_s: float):
        """`liveness_s`: the liveness probe's period (0: no probe)."""
        self._argv_for = argv_for
        self.child: Optional[asyncio.subprocess.Process] = None
        self.port = port
        self.liveness_s = liveness_s
        self.num_restarts = 0
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> int:
        self.child, self.port = await start_model_service(self._argv_for(self.port))
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._restart_when_dead()))
        if self.liveness_s > 0:
            self._tasks.append(loop.create_task(self._kill_when_unresponsive()))
        return self.port

    async def _restart_when_dead(self) -> None:
        delay_s = self.FIRST_DELAY_S
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            assert self.child is not None  # start() made it
            status = await self.child.wait()
            delay_s = self.FIRST_DELAY_S if loop.time() - started > self.HEALTHY_S else delay_s
            log.warning("model_service_died", status=status, restart_in_s=delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, self.MAX_DELAY_S)
            try:
                self.child, _ = await start_model_service(self._argv_for(self.port))
            except RuntimeError as error:  # died while starting: wait() returns at once
                log.warning("model_service_restart_failed", error=str(error))
                continue
            self.num_restarts += 1
            log.warning("model_service_restarted", port=self.port, restarts=self.num_restarts)

    async def _kill_when_unresponsive(self) -> None:
        """The liveness probe: a child that failed FAILURES health checks in a row is killed
        (a dead or restarting one is not checked)."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            failures = 0
            while True:
                await asyncio.sleep(self.liveness_s)
                child = self.child
                if child is None or child.returncode is not None:
                    failures = 0
                    continue
                if await says_serving(health, self.liveness_s / 2):
                    failures = 0
                    continue
                failures += 1
                if failures >= self.FAILURES and child.returncode is None:
                    log.warning(
                        "model_service_unresponsive", failures=failures, period_s=self.liveness_s
                    )
                    child.kill()  # _restart_when_dead starts the next one
                    failures = 0

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        child = self.child
        if child is not None and child.returncode is None:
            child.terminate()
            with contextlib.suppress(ProcessLookupError, asyncio.TimeoutError):
                await asyncio.wait_for(child.wait(), 10)
