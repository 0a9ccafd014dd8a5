"""What a ReplicaSet shows of its replicas as one: their schedulers merged (admission checks
and status, for the doors), and each replica's metrics as labelled series plus the server's
totals. The views receive what they read (the schedulers, the facts, the series), never the set
itself."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from scheduler_service.core.loras import LoraState
from scheduler_service.core.request import Request, RequestOutput
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.client import EngineFacts
from scheduler_service.engine.replica_series import ReplicaSeries

# The replicas' schedulers now (replicas come and go), and the facts of the first one connected.
Schedulers = Callable[[], list[Scheduler]]
Facts = Callable[[], Optional[EngineFacts]]


class ReplicaMetrics:
    """What one replica's EngineLoop reports into: the labelled per-replica series, plus the
    server's unlabelled ones as totals over the replicas (anything else goes to Metrics as is)."""

    def __init__(self, series: ReplicaSeries, name: str, metrics, merged: MergedScheduler):
        self._series = series
        self._name = name
        self._metrics = metrics
        self._merged = merged

    def on_step(
        self, num_waiting: int, num_running: int, kv_usage: float, num_preemptions: int
    ) -> None:
        series = self._series
        series.waiting.labels(self._name).set(num_waiting)
        series.running.labels(self._name).set(num_running)
        series.kv_usage.labels(self._name).set(kv_usage)
        merged = self._merged
        usable = merged.kv.num_usable_blocks
        self._metrics.on_step(
            merged.num_waiting,
            len(merged.running),
            (usable - merged.kv.num_free_blocks) / usable if usable else 0.0,
            num_preemptions,
        )

    def on_outputs(self, outputs: Sequence[tuple[Request, RequestOutput]]) -> None:
        for _, output in outputs:
            if output.finish_reason is not None and output.usage is not None:
                self._series.prompt_tokens.labels(self._name).inc(output.usage.prompt_tokens)
                self._series.cached_tokens.labels(self._name).inc(output.usage.cached_tokens)
        self._metrics.on_outputs(outputs)

    def on_engine_up(self, up: bool) -> None:
        # The unlabelled engine-up gauge means "some replica serves" (ReplicaSet sets it); a
        # replica's own state is planserve_replica_up. Recoveries still count.
        if up and hasattr(self._metrics, "engine_recoveries"):
            self._metrics.engine_recoveries.inc()

    def on_lora(self, loras: LoraState) -> None:
        """vllm:lora_requests_info over every replica: the union of their running and waiting
        adapters (one series, as one vLLM pod shows)."""
        states = [s.loras for s in self._merged.schedulers()]
        running = sorted({name for state in states for name in state.running_names()})
        waiting = sorted({name for state in states for name in state.waiting_names()})
        self._metrics.vllm.on_lora(loras.max_loras, running, waiting)

    def __getattr__(self, name: str):
        return getattr(self._metrics, name)


class _MergedKV:
    def __init__(self, schedulers: Schedulers, facts: Facts):
        self._schedulers = schedulers
        self._facts = facts

    @property
    def num_usable_blocks(self) -> int:
        return sum(s.kv.num_usable_blocks for s in self._schedulers())

    @property
    def num_free_blocks(self) -> int:
        return sum(s.kv.num_free_blocks for s in self._schedulers())

    @property
    def capacity_tokens(self) -> int:
        # One request lives on one replica: it must fit the smallest.
        return min((s.kv.capacity_tokens for s in self._schedulers()), default=0)

    def reset_prefix_cache(self) -> bool:
        """Every replica's (each one that holds no block forgets its cache); True if all did."""
        return all([s.kv.reset_prefix_cache() for s in self._schedulers()])

    @property
    def block_size(self) -> int:
        facts = self._facts()
        if facts is None:
            raise RuntimeError("no replica has connected yet")
        return facts.block_size


class MergedScheduler:
    """The replicas' schedulers seen as one, for the servicer (admission checks, status)."""

    def __init__(self, schedulers: Schedulers, facts: Facts):
        self._schedulers = schedulers
        self._facts = facts
        self.kv = _MergedKV(schedulers, facts)

    @property
    def facts(self) -> Optional[EngineFacts]:
        return self._facts()

    def schedulers(self) -> list[Scheduler]:
        """Each replica's Scheduler."""
        return list(self._schedulers())

    def find(self, request_id: str) -> Optional[Request]:
        for scheduler in self._schedulers():
            found = scheduler.find(request_id)
            if found is not None:
                return found
        return None

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self._schedulers())

    @property
    def num_waiting_tokens(self) -> int:
        return sum(s.num_waiting_tokens for s in self._schedulers())

    @property
    def running(self) -> list[Request]:
        return [request for s in self._schedulers() for request in s.running]

    @property
    def requests(self) -> dict[str, Request]:
        merged: dict[str, Request] = {}
        for scheduler in self._schedulers():
            merged.update(scheduler.requests)
        return merged

    @property
    def num_preemptions_total(self) -> int:
        return sum(s.num_preemptions_total for s in self._schedulers())

    def has_work(self) -> bool:
        return any(s.has_work() for s in self._schedulers())
