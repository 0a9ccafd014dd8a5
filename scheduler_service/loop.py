"""The engine loop: schedule, execute on the model service, update, deliver. One step at a time.

It sleeps while there is no work and wakes when a request arrives or is aborted.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import structlog

from scheduler_service.engine_client import EngineClient
from scheduler_service.metrics import Metrics
from scheduler_service.request import FinishReason, Request, RequestOutput
from scheduler_service.scheduler import Scheduler

log = structlog.get_logger("planserve.loop")


class EngineLoop:
    def __init__(self, scheduler: Scheduler, client: EngineClient,
                 metrics: Optional[Metrics] = None):
        self.scheduler = scheduler
        self.client = client
        self.metrics = metrics
        self._num_preemptions_seen = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_steps = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._wake.set()

    def abort_request(self, request_id: str) -> bool:
        """False when no such request is in flight."""
        found = self.scheduler.abort_request(request_id)
        self._wake.set()
        return found

    async def _run(self) -> None:
        try:
            while True:
                if not self.scheduler.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._step()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine loop failed; failing every request in flight")
            self._fail_all()
            raise

    async def _step(self) -> None:
        plan = self.scheduler.schedule()
        self._deliver(self.scheduler.take_early_outputs())
        if plan.is_empty:
            # Nothing could be scheduled: wait for news (an arrival, an abort) instead of
            # spinning; the timeout only guards against a missed wake-up.
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.05)
            except asyncio.TimeoutError:
                pass
            return
        result = await self.client.execute(plan)
        self.num_steps += 1
        self._deliver(self.scheduler.update(plan, result))
        if self.metrics is not None:
            scheduler = self.scheduler
            usable = scheduler.kv.num_usable_blocks
            preemptions = scheduler.num_preemptions_total - self._num_preemptions_seen
            self._num_preemptions_seen = scheduler.num_preemptions_total
            self.metrics.on_step(scheduler.num_waiting, len(scheduler.running),
                                 (usable - scheduler.kv.num_free_blocks) / usable, preemptions)

    def _deliver(self, outputs: list[tuple[Request, RequestOutput]]) -> None:
        for request, output in outputs:
            request.outputs.put_nowait(output)
            if self.metrics is not None:
                self.metrics.on_output(request, output)

    def _fail_all(self) -> None:
        for request in list(self.scheduler.requests.values()):
            request.outputs.put_nowait(RequestOutput(
                token_ids=[], text="", finish_reason=FinishReason.ERROR, index=request.index))
            for output in request.unforked_finals(FinishReason.ERROR):
                request.outputs.put_nowait(output)
