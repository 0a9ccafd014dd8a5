"""What the Scheduler's parts share: the scheduler's state, declared for the type checker.

The Scheduler (core/scheduler.py) is one class split by lifecycle into parts (departures,
waiting, preemption, forks, overlap), each a base class of it. Scheduler.__init__ sets the
state below; a part reads and writes it, and calls the other parts' methods, as the scheduler's
own methods do. Declared under TYPE_CHECKING only: nothing here exists at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from cython_ext.step_core import StepCore
    from scheduler_service.config import SchedulerConfig
    from scheduler_service.core.kv_blocks import KVBlockManager
    from scheduler_service.core.loras import LoraState
    from scheduler_service.core.plan import NewSequence, StepPlan
    from scheduler_service.core.policies.base import SchedulingPolicy
    from scheduler_service.core.request import Request, RequestOutput, TokenLogprob
    from scheduler_service.core.slots import SlotAllocator
    from scheduler_service.core.swap import SwapSpace
    from scheduler_service.engine.client import EngineFacts
    from scheduler_service.text.outputs import OutputProcessor


class SchedulerPart:
    if TYPE_CHECKING:
        config: SchedulerConfig
        facts: EngineFacts
        outputs: OutputProcessor
        kv: KVBlockManager
        slots: SlotAllocator
        swap: SwapSpace
        policy: SchedulingPolicy
        core: StepCore
        max_num_seqs: int
        token_budget: int
        running: list[Request]
        requests: dict[str, Request]
        num_preemptions_total: int
        _abort_ids: set[str]
        _deadlines: list[tuple[float, str]]
        _finished_slots: list[int]
        _aborted_slots: list[int]
        _early_outputs: list[tuple[Request, RequestOutput]]
        _groups: dict[str, list[Request]]
        _pending_forks: dict[int, tuple[NewSequence, Optional[tuple[int, int]]]]
        _plan: Optional[StepPlan]
        _num_constrained: int
        _waiting_tokens: tuple[tuple[int, int], int]
        _next_step_id: int
        _preempts_for_waiting: bool
        loras: LoraState

        def _enqueue(self, request: Request) -> None: ...
        def _lora_skip(self, request: Request) -> bool: ...
        def _lora_step_start(self) -> None: ...
        def _lora_admitted(self, request: Request) -> None: ...
        def _lora_preempt(self, plan: StepPlan) -> None: ...

        def _preempt(self, request: Request, plan: StepPlan) -> None: ...
        def _free_blocks(self, request: Request) -> None: ...
        def _swap_in(self, plan: StepPlan, request: Request, slot: int) -> None: ...
        def _new_sequence(
            self, request: Request, slot: int, token_ids: list[int]
        ) -> NewSequence: ...
        def _release(self, request: Request, lifecycle: list[int]) -> None: ...
        def _take_tokens(
            self,
            request: Request,
            token_ids: list[int],
            entries: Optional[list[TokenLogprob]],
            now: float,
            placeholder: Optional[int] = None,
        ) -> Optional[RequestOutput]: ...
