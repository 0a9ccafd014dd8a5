"""The scheduler: one token budget per step, shared by everything that has tokens to compute.

Requests are added and aborted from the serving layer; `schedule()` builds the next step's plan
and `update()` applies the model service's result to it. Both run on the event loop thread, one
step at a time, so no locking is needed.
"""
from __future__ import annotations

import time
from typing import Optional

from scheduler_service.config import SchedulerConfig
from scheduler_service.engine_client import EngineFacts
from scheduler_service.kv_blocks import KVBlockManager
from scheduler_service.outputs import OutputProcessor
from scheduler_service.plan import NewSequence, StepPlan, StepResult
from scheduler_service.queues import FCFSQueue
from scheduler_service.request import FinishReason, Request, RequestOutput, RequestStatus


class SlotAllocator:
    """Dense slot indices for the model service's per-sequence state; lowest free first."""

    def __init__(self, num_slots: int):
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)


class Scheduler:
    def __init__(self, config: SchedulerConfig, facts: EngineFacts, outputs: OutputProcessor):
        self.config = config
        self.facts = facts
        self.outputs = outputs
        self.kv = KVBlockManager(facts.num_kv_blocks, facts.block_size)
        self.slots = SlotAllocator(facts.max_num_slots)
        self.max_num_seqs = min(config.max_num_seqs, facts.max_num_slots)
        self.waiting = FCFSQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._next_step_id = 1
        # Lifecycle news for the model service, sent with the next plan.
        self._finished_slots: list[int] = []
        self._aborted_slots: list[int] = []
        # Outputs decided by schedule() itself (aborts), delivered with the step's own.
        self._abort_outputs: list[tuple[Request, RequestOutput]] = []

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise KeyError(request.request_id)
        self.requests[request.request_id] = request
        self.outputs.start(request)
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> None:
        """Marks a request aborted; it leaves, and frees its blocks, in the next schedule()."""
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            request.abort_requested = True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._finished_slots or self._aborted_slots
                    or any(r.abort_requested for r in self.requests.values()))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- the step ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Builds one step's plan.

        The step rule: a sequence has no prefill or decode phase, only num_computed_tokens
        catching up with its num_tokens. One budget of max_num_batched_tokens (and
        max_num_seqs) is shared by everyone:
          1. running sequences first, in arrival order: a decode takes 1 token, an unfinished
             prompt takes the next chunk of what is left of the budget;
          2. then waiting sequences in queue order, chunked to what is left.
        When blocks run out for a running sequence, the latest-arrived running sequence is
        preempted by recompute (blocks freed, requeued ahead of fresh requests) until it fits.
        A waiting sequence that does not fit stops admission (first come, first served).
        """
        self._abort_outputs.extend(self._collect_aborts())
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        budget = self.config.max_num_batched_tokens
        preempted_slots: list[int] = []

        scheduled: set[int] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens_to_compute, budget)
            num_blocks = self.kv.num_blocks_needed(request, num_new_tokens)
            while not self.kv.can_allocate(num_blocks):
                victim = self.running.pop()  # the latest arrival
                preempted_slots.append(self._preempt(victim))
                if victim is request:
                    break
            else:
                self._schedule(plan, request, num_new_tokens, num_blocks)
                scheduled.add(id(request))
                budget -= num_new_tokens
                index += 1
                continue
            break  # the request preempted itself: nothing else fits either

        while (self.waiting and budget > 0 and len(plan.slots) < self.max_num_seqs
               and self.slots.num_free > 0 and not preempted_slots):
            request = self.waiting.peek()
            num_new_tokens = min(request.num_tokens_to_compute, budget)
            num_blocks = self.kv.num_blocks_needed(request, num_new_tokens)
            if not self.kv.can_allocate(num_blocks):
                break
            self.waiting.pop()
            self._admit(plan, request)
            self._schedule(plan, request, num_new_tokens, num_blocks)
            budget -= num_new_tokens

        plan.finished_slots, self._finished_slots = self._finished_slots, []
        plan.aborted_slots, self._aborted_slots = self._aborted_slots, []
        plan.preempted_slots = preempted_slots
        return plan

    def _admit(self, plan: StepPlan, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.slot = self.slots.allocate()
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        plan.new_sequences.append(NewSequence(
            slot=request.slot, token_ids=request.all_token_ids, sampling=request.sampling,
            num_computed_tokens=request.num_computed_tokens))
        request.registered = True
        self.running.append(request)

    def _schedule(self, plan: StepPlan, request: Request, num_new_tokens: int,
                  num_blocks: int) -> None:
        new_block_ids = self.kv.allocate(request, num_blocks)
        plan.requests.append(request)
        plan.slots.append(request.slot)
        plan.num_scheduled_tokens.append(num_new_tokens)
        plan.num_new_blocks.append(len(new_block_ids))
        plan.new_block_ids.extend(new_block_ids)

    def _preempt(self, request: Request) -> int:
        """Recompute preemption: free everything, requeue at the front. Returns the slot."""
        slot = request.slot
        self.kv.free(request)
        self.slots.free(slot)
        request.slot = None
        request.registered = False
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.add_preempted(request)
        return slot

    def _collect_aborts(self) -> list[tuple[Request, RequestOutput]]:
        outputs = []
        for request in [r for r in self.requests.values() if r.abort_requested]:
            if request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            else:
                self.running.remove(request)
            outputs.append((request, self._finish(request, FinishReason.CANCELLED,
                                                  self._aborted_slots)))
        return outputs

    def _finish(self, request: Request, reason: FinishReason,
                lifecycle: list[int]) -> RequestOutput:
        """Ends a request that is not in `running` any more: frees its blocks and slot."""
        output = self.outputs.finish(request, reason)
        self._release(request, lifecycle)
        return output

    def _release(self, request: Request, lifecycle: list[int]) -> None:
        self.kv.free(request)
        if request.slot is not None:
            self.slots.free(request.slot)
            lifecycle.append(request.slot)
            request.slot = None
        request.status = RequestStatus.FINISHED
        request.abort_requested = False
        self.outputs.release(request)
        del self.requests[request.request_id]

    def take_abort_outputs(self) -> list[tuple[Request, RequestOutput]]:
        outputs, self._abort_outputs = self._abort_outputs, []
        return outputs

    def update(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, RequestOutput]]:
        """Applies a step's result: computed counts advance, sampled tokens are appended,
        stops are checked, and finished requests free their blocks."""
        outputs: list[tuple[Request, RequestOutput]] = []
        now = time.monotonic()
        offset = 0
        for request, num_scheduled, num_sampled in zip(
                plan.requests, plan.num_scheduled_tokens, result.num_sampled_tokens):
            token_ids = result.sampled_token_ids[offset:offset + num_sampled]
            offset += num_sampled
            if request.is_finished or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted after this plan was built
            request.num_computed_tokens += num_scheduled
            if not token_ids:
                continue  # a prompt chunk that did not reach the end yet
            if request.first_token_time is None:
                request.first_token_time = now
            output = self.outputs.add_tokens(request, token_ids)
            if request.finish_reason is not None:
                self.running.remove(request)
                self._release(request, self._finished_slots)
            outputs.append((request, output))
        return outputs

    def find(self, request_id: str) -> Optional[Request]:
        return self.requests.get(request_id)
