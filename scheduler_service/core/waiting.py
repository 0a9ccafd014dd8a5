"""Step 2 of the step rule: waiting requests admitted in the policy's order, chunked to what is
left of the budget, a prefix-cache hit starting them at the cached length; and how the model
service learns of a sequence (its registration, at admission, resume or fork); the queue's
token count, which the queue bound reads on every add.

A part of the Scheduler (core/scheduler.py), split off by lifecycle: it reads and writes
the scheduler's state as the scheduler's own methods do."""

from __future__ import annotations

import sys
import time
from typing import Optional

from scheduler_service.core.kv_blocks import cdiv
from scheduler_service.core.lora_admission import MAX_SKIPS_PER_STEP, lora_blocked
from scheduler_service.core.part import SchedulerPart
from scheduler_service.core.plan import NewSequence, StepPlan
from scheduler_service.core.request import Request, RequestStatus


class WaitingAdmission(SchedulerPart):
    """Admitting waiting requests into a step (a part of Scheduler)."""

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests (fresh and preempted) still have to compute. The queue's
        token bound reads it on every add, and a burst of adds between two steps would walk the
        queue once each (quadratic in the burst): the sum is taken once and add_request keeps it
        up until anything else changes the queue (a step, or the queue's length moving without
        an add)."""
        counted_at = (self._next_step_id, len(self.policy))
        if self._waiting_tokens[0] != counted_at:
            self._waiting_tokens = (
                counted_at,
                sum(request.num_tokens_to_compute for request in self.policy),
            )
        return self._waiting_tokens[1]

    def _enqueue_counted(self, request: Request) -> None:
        """A new request queued; num_waiting_tokens' sum kept up when it was current."""
        counted_at, num_tokens = self._waiting_tokens
        current = counted_at == (self._next_step_id, len(self.policy))
        self._enqueue(request)
        if current:
            self._waiting_tokens = (
                (self._next_step_id, len(self.policy)),
                num_tokens + request.num_tokens_to_compute,
            )

    def _schedule_waiting(self, plan: StepPlan, now: float) -> None:
        core, policy = self.core, self.policy
        if not (len(policy) and core.budget_open and self.slots.num_free > 0):
            return
        if not self.loras.enabled:
            self._admit_waiting(plan, now, None)
            return
        # Requests skipped for their adapter (core/lora_admission.py) leave the queue for the
        # rest of this step and go back to their places after it.
        skipped: list[Request] = []
        self._lora_step_start()
        try:
            self._admit_waiting(plan, now, skipped)
        finally:
            for request in skipped:
                policy.put_back(request)

    def _admit_waiting(self, plan: StepPlan, now: float, skipped: Optional[list[Request]]) -> None:
        """Admits waiting requests in the policy's order until the budget, the slots or the
        blocks run out; `skipped` (with LoRA): where requests held back for their adapter go."""
        core, kv, policy = self.core, self.kv, self.policy
        reserve = core.decode_reserve_blocks()
        while len(policy) and core.budget_open and self.slots.num_free > 0:
            request = policy.peek(now)
            if request is None or policy.admission_veto(request, self.running):
                return
            if skipped is not None and request.lora_name and self._lora_skip(request):
                if len(skipped) >= MAX_SKIPS_PER_STEP:
                    return
                skipped.append(policy.pop(now))
                continue
            hits: list[int]
            swapped = self.swap.held_blocks(request) is not None
            if swapped:  # resumes at its computed count, its KV swapped back in
                hits, num_free_hits, num_cached = [], 0, request.num_computed_tokens
            else:
                hits, num_free_hits = kv.find_cached_prefix(request)
                num_cached = len(hits) * kv.block_size
            num_new_tokens = core.chunk(request.num_tokens - num_cached)
            if num_new_tokens == 0:
                return
            num_blocks = cdiv(num_cached + num_new_tokens, kv.block_size) - len(hits)
            if num_blocks + num_free_hits + reserve > kv.num_free_blocks:
                return  # wait for room rather than overtake (the policy's order holds)
            policy.pop(now)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            slot = self._admit(plan, request, hits, num_cached)
            core.schedule_admitted(slot, num_new_tokens, num_blocks)
            if swapped:
                self._swap_in(plan, request, slot)
            reserve += core.reserve_blocks_of(slot, num_new_tokens)

    def _fits(self, request: Request) -> bool:
        """Whether the waiting request's first chunk could be admitted right now (parked
        sequences take a slot but no place in the step: core/lora_parking.py)."""
        num_in_step = len(self.running)
        if self.loras.turns.on:
            active = self.loras.turns.active
            num_in_step = sum(1 for r in self.running if not r.lora_name or r.lora_name in active)
        if num_in_step >= self.max_num_seqs or self.slots.num_free == 0:
            return False
        hits: list[int]
        if self.swap.held_blocks(request) is not None:
            hits, num_free_hits, num_cached = [], 0, request.num_computed_tokens
        else:
            hits, num_free_hits = self.kv.find_cached_prefix(request)
            num_cached = len(hits) * self.kv.block_size
        first_chunk = min(
            request.num_tokens - num_cached,
            self.token_budget,
            self.config.max_prefill_chunk or sys.maxsize,
        )
        num_blocks = cdiv(num_cached + first_chunk, self.kv.block_size) - len(hits)
        return num_blocks + num_free_hits <= self.kv.num_free_blocks

    def _preempt_for_waiting(self, plan: StepPlan, head: Optional[Request]) -> None:
        """Preemption for waiting requests, before the step's running sequences are scheduled:
        preemptive LoRA rotation first (core/lora_admission.py), then running sequences the
        policy ranks below the head of the queue until the head fits (lowest rank first).
        FCFS-like policies never rank a waiting request above a running one, so for them the
        second never runs (see _preempts_for_waiting)."""
        if self.loras.enabled:
            self._lora_preempt(plan)
        if not self._preempts_for_waiting:
            return
        if head is not None and lora_blocked(self.loras, head) is not None:
            return  # preempting would not let it in: its adapter holds it back
        while head is not None and self.running and not self._fits(head):
            victim = self.policy.select_victim(self.running)
            if not self.policy.may_preempt_for(head, victim):
                return
            self._preempt(victim, plan)

    def _admit(self, plan: StepPlan, request: Request, hits: list[int], num_computed: int) -> int:
        """Starts `request` in a slot with `num_computed` tokens computed (its prefix-cache hits,
        or what its swap-out kept); from here the StepCore owns its count and block table.
        Returns the slot."""
        request.status = RequestStatus.RUNNING
        slot = request.slot = self.slots.allocate()
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        token_ids = request.all_token_ids
        self.core.admit(
            slot,
            request,
            token_ids,
            num_computed,
            hits,
            len(request.prompt_token_ids) + request.stopping.max_new_tokens,
            self.kv.salt(request),
            self._lookahead(request),
        )
        plan.new_sequences.append(self._new_sequence(request, slot, token_ids))
        self.running.append(request)
        if request.lora_name:
            self._lora_admitted(request)
            if self.kv.logs_events:
                self.kv.note_lora_root(request)
        return slot

    def _lookahead(self, request: Request) -> int:
        """Draft tokens granted to each decode of `request`: the engine's k when it speculates
        and the request needs nothing per token that drafts would have to honour (logprobs,
        penalties, bias, min tokens, a grammar)."""
        k = self.facts.num_speculative_tokens
        if not k or request.logprobs is not None or request.structured is not None:
            return 0
        sampling, stopping = request.sampling, request.stopping
        if (
            sampling.repetition_penalty != 1.0
            or sampling.presence_penalty
            or sampling.frequency_penalty
            or sampling.logit_bias
            or stopping.min_new_tokens
        ):
            return 0
        return k

    def _new_sequence(self, request: Request, slot: int, token_ids: list[int]) -> NewSequence:
        """How the model service learns of a sequence in `slot` (at admission, resume or
        fork)."""
        stopping = request.stopping
        suppressed: tuple[int, ...] = ()
        if stopping.min_new_tokens:
            eos = () if stopping.ignore_eos else self.facts.eos_token_ids
            suppressed = tuple(sorted(set(eos) | stopping.stop_token_ids))
        # Prompt logprobs are asked for until every prompt position has one (a recompute after
        # a preemption mid-prompt asks again; entries already held are skipped on arrival).
        prompt_logprobs = request.prompt_logprobs
        if (
            prompt_logprobs is not None
            and len(request.prompt_logprobs_out) >= len(request.prompt_token_ids) - 1
        ):
            prompt_logprobs = None
        return NewSequence(
            slot=slot,
            token_ids=token_ids,
            sampling=request.sampling,
            num_computed_tokens=request.num_computed_tokens,
            num_prompt_tokens=len(request.prompt_token_ids),
            min_new_tokens=stopping.min_new_tokens,
            min_tokens_suppressed_ids=suppressed,
            num_logprobs=request.logprobs,
            num_prompt_logprobs=prompt_logprobs,
            speculate=self._lookahead(request) > 0,
            lora_id=request.lora_id,
        )
