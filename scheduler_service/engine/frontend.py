"""What the doors see of the engine side: `EngineFrontend`.

One model service is driven by an `EngineLoop` (engine/loop.py); several replicas by a
`ReplicaSet` (engine/replicas.py) that routes each request to one of their loops. Both implement
this protocol, so the doors (api/) never tell them apart.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

from scheduler_service.core.loras import LoraState
from scheduler_service.core.request import Request, RequestOutput


class EngineMetrics(Protocol):
    """What an engine loop reports into and the doors count refusals with: the server's
    Metrics, or a replica's ReplicaMetrics (engine/merged.py) that labels and totals them."""

    def on_step(
        self, num_waiting: int, num_running: int, kv_usage: float, num_preemptions: int
    ) -> None: ...
    def on_forward(self, forward_ns: int) -> None: ...
    def on_speculation(self, num_draft_tokens: int, num_accepted_tokens: int) -> None: ...
    def on_engine_up(self, up: bool) -> None: ...
    def on_outputs(self, outputs: Sequence[tuple[Request, RequestOutput]]) -> None: ...
    def on_rejected(self, reason: str) -> None: ...
    def on_lora(self, loras: LoraState) -> None: ...


class KVView(Protocol):
    """The block pool's figures the doors read (admission bound, status)."""

    @property
    def capacity_tokens(self) -> int: ...

    @property
    def num_usable_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    def reset_prefix_cache(self) -> bool: ...


class SchedulerView(Protocol):
    """The scheduler's state the doors read: one Scheduler, or the replicas' merged."""

    # Read-only: a Scheduler's KVBlockManager (or the replicas' merged view) is a KVView, and
    # a protocol's plain attribute would have to be exactly KVView.
    @property
    def kv(self) -> KVView: ...

    def find(self, request_id: str) -> Optional[Request]: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_waiting_tokens(self) -> int: ...

    @property
    def running(self) -> list[Request]: ...

    @property
    def requests(self) -> dict[str, Request]: ...


class EngineFrontend(Protocol):
    """Requests in and out of the engine side, and what it reports."""

    @property
    def scheduler(self) -> SchedulerView: ...

    @property
    def metrics(self) -> Optional[EngineMetrics]: ...

    @property
    def tokens_per_s(self) -> float:
        """Tokens computed per second lately (the retry hint's rate)."""
        ...

    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: str) -> bool:
        """False when no such request is in flight."""
        ...

    def statuses(self) -> list[dict]:
        """One entry per replica (generate.proto ReplicaStatus fields); none for one engine."""
        ...

    async def stop(self) -> None: ...
