"""The engine loop: schedule, execute on the model service, update, deliver.

With overlap (SchedulerConfig.overlap, the default) the loop keeps two plans in flight: it
builds and sends step N+1 while the model service computes step N, committing each plan as if it
had completed (Scheduler.commit: counts advance, sampled tokens are placeholders; the model
service feeds its own sampled tokens to the next step) and reconciling when the result comes
(Scheduler.reconcile: real ids, stops, releases). A request that stopped at step N was already
scheduled in N+1: that token is computed and discarded. A grammar-constrained sequence sits out
the plan built while its token is in flight (its mask needs that token), so it runs every other
plan while the others keep both in flight. While the engine speculates, the next plan depends on
the last tokens, so steps go one at a time.

It sleeps while there is no work and wakes when a request arrives or is aborted.

When the model service goes away (killed, restarted, its stream broken) the loop marks the engine
down (health NOT_SERVING), reconnects with backoff, checks the new process with a real one-token
step, and resumes: every sequence in flight is recomputed from its prompt plus the tokens already
streamed (the scheduler's recompute preemption, applied to all of them at once), so clients see a
delay and never a token twice. While idle it checks the model service's health every
`engine_check_interval_s`, so that readiness also drops when nothing is running.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable, Optional

import structlog

from cython_ext.step_outputs import put_outputs
from scheduler_service.core.lora_registry import LoraRegistry
from scheduler_service.core.request import FinishReason, Request, RequestOutput
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.client import EngineClient, EngineFacts, EngineUnavailable
from scheduler_service.engine.frontend import EngineMetrics
from scheduler_service.engine.kv_events import KVEventStream
from scheduler_service.engine.lora_loader import AdapterLoader
from scheduler_service.engine.step_timeout import StepTimeout

log = structlog.get_logger("planserve.loop")


class EngineLoop:
    """Drives one model service; an EngineFrontend (engine/frontend.py)."""

    # Reconnect backoff: doubles from the first to the last, then stays.
    FIRST_BACKOFF_S = 0.1
    MAX_BACKOFF_S = 5.0
    # Model-service failures a sequence may run through and still be recomputed. A service
    # that fails on what it is sent may complete steps between failures (say, each recompute
    # before the next decode fails), so "no step since the last failure" cannot tell it from
    # an outage; a count per sequence ends the sequences it keeps failing on.
    MAX_ENGINE_FAILURES_PER_REQUEST = 3

    def __init__(
        self,
        scheduler: Scheduler,
        client: EngineClient,
        metrics: Optional[EngineMetrics] = None,
        on_engine_up: Optional[Callable[[bool], None]] = None,
        engine_check_interval_s: float = 1.0,
        is_compatible: Optional[Callable[[EngineFacts], Optional[str]]] = None,
        kv_events: Optional[KVEventStream] = None,
        lora_registry: Optional[LoraRegistry] = None,
    ):
        self.scheduler = scheduler
        self.kv_events = kv_events  # publishes the pool's KV-cache events after each step
        if kv_events is not None:
            kv_events.lora_roots = scheduler.kv.lora_roots
        self.client = client
        # LoRA adapters: the loads and evictions the scheduler decides (engine/lora_loader.py).
        self.adapters = AdapterLoader(scheduler, client, lora_registry or LoraRegistry(), self.wake)
        self.metrics = metrics
        self._on_engine_up = on_engine_up or (lambda up: None)
        self._check_interval_s = engine_check_interval_s
        # Says why a restarted model service cannot take over the requests in flight (None: it can).
        self._is_compatible = is_compatible or (lambda facts: None)
        self.engine_up = True
        self.num_engine_recoveries = 0
        self._num_preemptions_seen = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_steps = 0
        # Overlap: plans sent whose results have not come back, oldest first (at most two).
        self._in_flight: collections.deque = collections.deque()
        self.max_in_flight_seen = 0
        # Tokens computed per second, a moving average over steps (the retry hint's rate).
        self.tokens_per_s = 0.0
        # A result awaited past --engine-step-timeout-seconds drops the stream (a recovery).
        self.step_timeout = StepTimeout(scheduler.config.engine_step_timeout_s, client.drop_stream)
        self._watch: asyncio.Task | None = None

    def start(self, engine_down: Optional[str] = None) -> None:
        """Starts stepping; with `engine_down` (why), reconnects first (the readiness probe
        failed: the model service answered Describe but could not compute)."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(engine_down), name="engine-loop")
        self._watch = loop.create_task(self.step_timeout.watch(), name="engine-step-timeout")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
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

    def wake(self) -> None:
        """News from outside the doors (requests moved onto this loop's scheduler): step."""
        self._wake.set()

    def statuses(self) -> list[dict]:
        return []  # one engine: GetServerStatus has no per-replica entries

    def abort_request(self, request_id: str) -> bool:
        """False when no such request is in flight."""
        found = self.scheduler.abort_request(request_id)
        self._wake.set()
        return found

    async def _run(self, engine_down: Optional[str] = None) -> None:
        """Steps until stopped. A failure nothing here expects (a plan the model service
        refuses, a bug) ends the requests in flight with ERROR, since recomputing them would
        meet it again, and the loop starts over on a new stream: later requests are served."""
        backoff_s, steps_at_failure = 0.0, -1
        while True:
            try:
                await self._serve(engine_down)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("engine loop failed; ending the requests in flight, reconnecting")
                self._end_all_failed()
                # Failures with no step between them back off: one that the loop meets each
                # time it starts over (say, in its own recovery) must not spin.
                if self.num_steps != steps_at_failure:
                    backoff_s = 0.0
                else:
                    backoff_s = min(max(2 * backoff_s, self.FIRST_BACKOFF_S), self.MAX_BACKOFF_S)
                steps_at_failure = self.num_steps
                await asyncio.sleep(backoff_s)
                engine_down = "the engine loop failed"

    async def _serve(self, engine_down: Optional[str]) -> None:
        if engine_down is not None:
            await self._recover(engine_down)
        while True:
            if not self.scheduler.has_work() and not self._in_flight:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self._check_interval_s)
                except asyncio.TimeoutError:
                    if not await self.client.is_alive(self._check_interval_s):
                        await self._recover("the model service failed its health check")
                continue
            try:
                await self._step()
            except EngineUnavailable as error:
                await self._recover(self.step_timeout.take_reason(str(error)))

    def _end_all_failed(self) -> None:
        """Every request in flight ends with ERROR, through the scheduler (what they held is
        freed); where the scheduler itself fails at that, each request's stream still gets its
        error and the loop stops, its state past trusting."""
        try:
            self.scheduler.end_all(FinishReason.ERROR)
            self._deliver(self.scheduler.take_early_outputs())
        except Exception:
            log.exception("ending the requests failed; the engine loop stops")
            self._fail_all()
            raise

    async def _step(self) -> None:
        scheduler = self.scheduler
        if scheduler.config.overlap and not scheduler.needs_lockstep:
            await self._overlapped_step()
            return
        if self._in_flight:  # lockstep from now on: finish what overlap sent first
            await self._finish_oldest()
            return
        plan = self.scheduler.schedule()
        self.adapters.pump()
        # Every event logged from here to the next step names this step.
        structlog.contextvars.bind_contextvars(step_id=plan.step_id)
        self._deliver(self.scheduler.take_early_outputs())
        if plan.is_empty:
            await self._wait_for_news()
            return
        started = time.perf_counter()
        with self.step_timeout.awaiting(plan.step_id, started):
            result = await self.client.execute(plan)
        self._finish(plan, result, started, self.scheduler.update)

    async def _overlapped_step(self) -> None:
        """Keeps the pipeline full: plan and send the next step while one is in flight, then
        take the oldest result."""
        scheduler = self.scheduler
        if len(self._in_flight) < 2 and scheduler.has_work():
            plan = scheduler.schedule()
            self.adapters.pump()
            structlog.contextvars.bind_contextvars(step_id=plan.step_id)
            self._deliver(scheduler.take_early_outputs())
            if not plan.is_empty:
                scheduler.commit(plan)
                await self.client.send(plan)
                self._in_flight.append((plan, time.perf_counter()))
                self.max_in_flight_seen = max(self.max_in_flight_seen, len(self._in_flight))
                if len(self._in_flight) < 2:
                    return  # plan the next one before waiting
            elif not self._in_flight:
                await self._wait_for_news()
                return
        if self._in_flight:
            await self._finish_oldest()

    async def _finish_oldest(self) -> None:
        plan, sent = self._in_flight[0]
        with self.step_timeout.awaiting(plan.step_id, sent):
            result = await self.client.receive(plan)
        self._in_flight.popleft()
        self._finish(plan, result, sent, self.scheduler.reconcile)

    async def _wait_for_news(self) -> None:
        """Nothing could be scheduled: wait for news (an arrival, an abort) instead of spinning;
        the timeout only guards against a missed wake-up."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=0.05)
        except asyncio.TimeoutError:
            pass

    def _finish(self, plan, result, sent: float, apply) -> None:
        """A step's result is in: `apply` (Scheduler.update in lockstep, reconcile under overlap)
        turns it into outputs, which are delivered; rate and metrics follow."""
        self._note_rate(plan.total_scheduled_tokens, time.perf_counter() - sent)
        self.num_steps += 1
        self._deliver(apply(plan, result))
        self._after_step(result)

    def _after_step(self, result) -> None:
        if self.scheduler.loras.enabled:
            self.adapters.pump()  # adapters idle since this result may be evicted now
        if self.kv_events is not None:
            self.kv_events.on_step(self.scheduler.kv.pool)
        if self.metrics is not None:
            scheduler = self.scheduler
            usable = scheduler.kv.num_usable_blocks
            preemptions = scheduler.num_preemptions_total - self._num_preemptions_seen
            self._num_preemptions_seen = scheduler.num_preemptions_total
            self.metrics.on_step(
                scheduler.num_waiting,
                len(scheduler.running),
                (usable - scheduler.kv.num_free_blocks) / usable,
                preemptions,
            )
            self.metrics.on_forward(result.forward_ns)
            if scheduler.loras.enabled:
                self.metrics.on_lora(scheduler.loras)
            if result.num_draft_tokens:
                self.metrics.on_speculation(
                    result.num_draft_tokens, result.num_accepted_draft_tokens
                )

    def _note_rate(self, num_tokens: int, seconds: float) -> None:
        if seconds > 0:
            rate = num_tokens / seconds
            self.tokens_per_s = (
                rate if not self.tokens_per_s else 0.9 * self.tokens_per_s + 0.1 * rate
            )

    async def _recover(self, why: str) -> None:
        """Engine down: health NOT_SERVING, every sequence back to waiting, then reconnect with
        backoff until a model service answers Describe and a real step; health SERVING again."""
        self.engine_up = False
        self._on_engine_up(False)
        if self.metrics is not None:
            self.metrics.on_engine_up(False)
        self.client.drop_stream()
        self._in_flight.clear()  # those plans' sequences are all recomputed
        num_failed = self.scheduler.end_repeat_failures(self.MAX_ENGINE_FAILURES_PER_REQUEST)
        self._deliver(self.scheduler.take_early_outputs())
        num_preempted = self.scheduler.reset_engine(self.scheduler.facts)
        log.warning(
            "engine_down",
            reason=why,
            num_preempted=num_preempted,
            num_in_flight=len(self.scheduler.requests),
        )
        if num_failed:
            log.error(
                "engine_fails_repeatedly; failing the sequences it failed on each time",
                num_failed=num_failed,
                failures=self.MAX_ENGINE_FAILURES_PER_REQUEST + 1,
            )
        backoff_s = self.FIRST_BACKOFF_S
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            # Aborts and deadlines still end requests while nothing can run.
            self.scheduler.collect_departures()
            self._deliver(self.scheduler.take_early_outputs())
            if await self._reconnect(attempt, max(backoff_s, 1.0)):
                break
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.MAX_BACKOFF_S)
        self.num_engine_recoveries += 1
        self.engine_up = True
        self._on_engine_up(True)
        if self.metrics is not None:
            self.metrics.on_engine_up(True)
        log.warning(
            "engine_up",
            attempts=attempt,
            down_s=round(time.monotonic() - started, 3),
            num_waiting=self.scheduler.num_waiting,
        )

    async def _reconnect(self, attempt: int, timeout_s: float) -> bool:
        """One try: Describe, the compatibility check, then the readiness probe (a real step);
        True once the model service has computed it."""
        try:
            facts = await self.client.describe(timeout_s)
            incompatible = self._is_compatible(facts)
            if incompatible is not None:
                log.error("engine_incompatible", reason=incompatible, attempt=attempt)
                return False
            self.scheduler.reset_engine(facts)
            first_step_id = self.scheduler.take_step_ids(2)
            with self.step_timeout.awaiting(first_step_id, time.perf_counter()):
                await self.client.probe(first_step_id, facts)
            return True
        except (EngineUnavailable, asyncio.TimeoutError, ConnectionError) as error:
            why = self.step_timeout.take_reason(str(error))
        except Exception as error:  # noqa: BLE001 - an AioRpcError of Describe, say
            why = repr(error)
        self.client.drop_stream()
        log.info("engine_reconnect_failed", attempt=attempt, error=why)
        return False

    def _deliver(self, outputs: list[tuple[Request, RequestOutput]]) -> None:
        for request, output in put_outputs(outputs):  # the finished: ids and counts, never content
            log.info(
                "request_finished",
                request_id=request.request_id,
                finish_reason=output.finish_reason.name,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=len(request.output_token_ids),
                preemptions=request.num_preemptions,
            )
        if self.metrics is not None and outputs:
            self.metrics.on_outputs(outputs)

    def _fail_all(self) -> None:
        for request in list(self.scheduler.requests.values()):
            request.outputs.put_nowait(
                RequestOutput(
                    token_ids=[], text="", finish_reason=FinishReason.ERROR, index=request.index
                )
            )
            for output in request.unforked_finals(FinishReason.ERROR):
                request.outputs.put_nowait(output)
