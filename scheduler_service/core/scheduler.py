"""The scheduler: one token budget per step, shared by everything that has tokens to compute.

Requests are added and aborted from the serving layer; `schedule()` builds the next step's plan
and `update()` applies the model service's result to it. Both run on the event loop thread, one
step at a time, so no locking is needed.

Python keeps the orchestration: Request objects and their lifecycle (admit, finish, abort,
deadline, outputs), the waiting queue and every policy decision. The loops over running sequences
(budget, chunking, block allocation, the plan's packed arrays, computed counts and prefix hashes
in update) run in cython_ext/step_core.pyx, called a few times per step. The pure-Python oracle
of the same decisions is tests/scheduler/oracle_scheduler.py.
"""
from __future__ import annotations

import heapq
import sys
import time
from typing import Optional

from cython_ext.block_pool import BlockPool
from cython_ext.step_core import PHASE_ALL, PHASE_DECODES, PHASE_PREFILLS, StepCore
from scheduler_service.core import policies
from scheduler_service.text import structured
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine.client import EngineFacts
from scheduler_service.core.kv_blocks import KVBlockManager, cdiv
from scheduler_service.text.outputs import OutputProcessor
from scheduler_service.core.plan import NewSequence, StepPlan, StepResult
from scheduler_service.core.policies.base import SchedulingPolicy
from scheduler_service.core.swap import SwapSpace
from scheduler_service.core.request import (FinishReason, Request, RequestOutput, RequestStatus,
                                       TokenLogprob)


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
    def __init__(self, config: SchedulerConfig, facts: EngineFacts, outputs: OutputProcessor,
                 policy: Optional[SchedulingPolicy] = None):
        self.config = config
        self.facts = facts
        self.outputs = outputs
        self.kv = KVBlockManager(facts.num_kv_blocks, facts.block_size,
                                 config.enable_prefix_caching, config.prefix_cache_scope)
        self.slots = SlotAllocator(facts.max_num_slots)
        # Host blocks for preemption by swap (none when preempting by recompute).
        self.swap = SwapSpace(self._usable_swap_blocks(facts))
        self.max_num_seqs = min(config.max_num_seqs, facts.max_num_slots)
        self.policy = policy or policies.create(
            config.policy, prefix_match_len=self.kv.num_cached_prefix_tokens)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._next_step_id = 1
        self.num_preemptions_total = 0
        # Speculative decoding, as the engine reports it: drafts proposed and accepted.
        self.num_draft_tokens_total = 0
        self.num_accepted_draft_tokens_total = 0
        self._abort_ids: set[str] = set()
        self._deadlines: list[tuple[float, str]] = []  # a heap
        # Lifecycle news for the model service, sent with the next plan.
        self._finished_slots: list[int] = []
        self._aborted_slots: list[int] = []
        # Outputs decided by schedule() itself (aborts, deadlines), delivered with the step's own.
        self._early_outputs: list[tuple[Request, RequestOutput]] = []
        # Parallel samples (n > 1): every sample of a request, by its public id, while any runs.
        self._groups: dict[str, list[Request]] = {}
        # Samples forked since the last plan, by slot: their registration and the copy-on-write
        # of the block their first token lands in, both sent with the next plan.
        self._pending_forks: dict[int, tuple[NewSequence, Optional[tuple[int, int]]]] = {}
        # Per-slot sequence state and the per-step loops over it, in C.
        policy_type = type(self.policy)
        self.core = self._new_core()
        # Only a policy that may preempt for a waiting request (priority) needs step 3's second
        # half; the base class's may_preempt_for always says no.
        self._preempts_for_waiting = (
            policy_type.may_preempt_for is not SchedulingPolicy.may_preempt_for)
        self._plan: Optional[StepPlan] = None
        # Requests in flight with structured output: only then are the plans' masks filled.
        self._num_constrained = 0

    def _new_core(self) -> StepCore:
        return StepCore(
            self.kv.pool, self.facts.block_size, self.facts.max_num_slots,
            max_prefill_chunk=self.config.max_prefill_chunk,
            decode_reserve_tokens=self.config.decode_reserve_tokens,
            enable_prefix_caching=self.config.enable_prefix_caching,
            on_blocks_exhausted=self._on_blocks_exhausted,
            # The base class's on_scheduled does nothing: skip 256 calls per step for it.
            on_scheduled=(None if type(self.policy).on_scheduled is SchedulingPolicy.on_scheduled
                          else self.policy.on_scheduled))

    def reset_engine(self, facts: EngineFacts) -> int:
        """The model service lost every sequence (it restarted, or its Execute stream broke):
        every running sequence is preempted, to be recomputed from its prompt plus the tokens
        already streamed, and the block pool starts empty (the cached KV is gone, so are the
        hashes that pointed at it). Lifecycle news meant for the old process is dropped; the
        plan in flight, if any, never happened. `facts` is the new process's Describe (its
        capacity may differ). Returns how many sequences were preempted."""
        plan = StepPlan(step_id=0)  # throwaway: no process will hear of these slots
        num_running = len(self.running)
        # The old process's swap space is gone too: swapped-out requests start over, and
        # nobody is swapped out to it now.
        for request in self.swap.discard_all():
            request.num_computed_tokens = 0
        self.swap = SwapSpace(0)
        # Last first: each goes to the front of the queue, so admission order is kept.
        for request in reversed(list(self.running)):
            self._preempt(request, plan)
        self._pending_forks.clear()
        self._finished_slots.clear()
        self._aborted_slots.clear()
        self.facts = facts
        self.kv.pool = BlockPool(facts.num_kv_blocks)
        self.slots = SlotAllocator(facts.max_num_slots)
        self.max_num_seqs = min(self.config.max_num_seqs, facts.max_num_slots)
        self.swap = SwapSpace(self._usable_swap_blocks(facts))
        self.core = self._new_core()
        return num_running

    def collect_departures(self) -> None:
        """Applies passed deadlines and aborts now, outside a step (while the model service is
        down nothing is running, so no slot is involved); their outputs wait in
        take_early_outputs()."""
        now = time.monotonic()
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire_deadlines(now)
        if self._abort_ids:
            self._collect_aborts()

    def end_all(self, reason: FinishReason) -> None:
        """Ends every request in flight for `reason` (outputs in take_early_outputs())."""
        for request in list(self.requests.values()):
            if not request.is_finished:
                self._end(request, reason, self._aborted_slots)

    def take_step_ids(self, count: int) -> int:
        """Reserves `count` consecutive step ids for plans built outside schedule() (the
        readiness probe); returns the first."""
        first = self._next_step_id
        self._next_step_id += count
        return first

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise KeyError(request.request_id)
        self.outputs.start(request)
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))
        if request.guide is not None:
            self._num_constrained += 1
        self.policy.add(request)

    def abort_request(self, request_id: str) -> bool:
        """Marks a request aborted; it leaves, and frees its blocks, in the next schedule().
        False when no such request is in flight."""
        request = self.requests.get(request_id)
        members = self._groups.get(request_id, [request] if request else [])
        live = [m.request_id for m in members if not m.is_finished]
        self._abort_ids.update(live)
        return bool(live)

    def has_work(self) -> bool:
        return bool(self.running or len(self.policy) or self._finished_slots
                    or self._aborted_slots or self._abort_ids)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    def find(self, request_id: str) -> Optional[Request]:
        """The in-flight request with this public id (sample 0 of a request with n > 1)."""
        members = self._groups.get(request_id)
        return members[0] if members else self.requests.get(request_id)

    def hand_off(self, request: Request) -> Optional[list[Request]]:
        """Takes a waiting request (holding no slot and no block: fresh, or preempted) out of
        this scheduler, for another to `take_over` (a replica's, sharing the OutputProcessor).
        Returns its parallel-sample group when this scheduler held it (it goes along)."""
        if request.status is not RequestStatus.WAITING or request.slot is not None:
            raise ValueError(f"request {request.request_id!r} is {request.status.name}, not waiting")
        self.policy.remove(request)
        del self.requests[request.request_id]
        if request.guide is not None:
            self._num_constrained -= 1
        return self._groups.pop(request.public_id, None)

    def take_over(self, request: Request, group: Optional[list[Request]]) -> None:
        """A waiting request handed off by another scheduler: queued as add_request queues
        one, its tokens so far recomputed here like a preempted request's; its detokenizer
        (in the shared OutputProcessor) is kept, so the text goes on where the client is."""
        self._enqueue(request)
        if group is not None:
            self._groups[request.public_id] = group

    def take_early_outputs(self) -> list[tuple[Request, RequestOutput]]:
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

    # ---- the step ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Builds one step's plan.

        The step rule: a sequence has no prefill or decode phase, only num_computed_tokens
        catching up with its num_tokens. One budget of max_num_batched_tokens and max_num_seqs
        is shared by everyone:
          1. running sequences first: a decode takes 1 token, an unfinished prompt its next
             chunk (at most max_prefill_chunk tokens);
          2. then waiting sequences in the policy's order, chunked to what is left; a prefix
             cache hit starts them at the cached length; one is admitted only if every running
             sequence keeps decode_reserve_tokens of room to grow;
          3. when blocks run out for a running sequence, the policy's victim is preempted
             (blocks freed, requeued ahead of fresh requests of equal rank; by swap when the
             swap space holds its KV, else by recompute) until it fits; a policy that ranks requests (priority) also preempts lower-ranked running
             sequences for the head of the queue.
        The chunking mode only changes the order of 1 and 2 (see SchedulerConfig).
        Aborted requests and passed deadlines leave first, freeing their blocks in this step.
        Step 1 and the block and budget arithmetic run in C (StepCore); step 2's order and
        step 3's victims are the policy's, in Python.
        """
        now = time.monotonic()
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire_deadlines(now)
        if self._abort_ids:
            self._collect_aborts()
        plan = self._plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        if len(self.policy):
            # Peek even when nothing will be preempted: a policy may fix its answer for `now`
            # at the first peek (fair does, before this step's charges move its counters).
            head = self.policy.peek(now)
            if self._preempts_for_waiting:
                self._preempt_for_waiting(plan, head)

        core = self.core
        core.begin_step(plan.step_id, self.config.max_num_batched_tokens, self.max_num_seqs)
        mode = self.config.chunking_mode
        if mode == "interleaved":
            core.schedule_running(PHASE_ALL)
            self._schedule_waiting(plan, now)
        elif mode == "prefill-first":
            core.schedule_running(PHASE_PREFILLS)
            self._schedule_waiting(plan, now)
            core.schedule_running(PHASE_DECODES)
        else:  # decode-priority
            core.schedule_running(PHASE_DECODES)
            core.limit_prefill_chunks(1)
            core.schedule_running(PHASE_PREFILLS)
            self._schedule_waiting(plan, now)

        (plan.requests, plan.slots, plan.num_scheduled_tokens, plan.num_new_blocks,
         plan.new_block_ids, plan.packed) = core.end_step()
        self._plan = None
        if self._pending_forks:
            self._register_forks(plan)
        if self._num_constrained:
            structured.fill_plan_masks(plan)
        if self._finished_slots:
            plan.finished_slots, self._finished_slots = self._finished_slots, []
        if self._aborted_slots:
            plan.aborted_slots, self._aborted_slots = self._aborted_slots, []
        self.swap.end_plan()
        return plan

    def _on_blocks_exhausted(self, slot: int) -> bool:
        """StepCore's call when the sequence in `slot` needs more blocks than are free: preempts
        the policy's victim among the running sequences not yet scheduled in this step. True when
        the victim is that sequence itself (nothing else fits either)."""
        core = self.core
        request = self.running_in(slot)
        victim = self.policy.select_victim(
            [r for r in self.running if not core.is_scheduled(r.slot)])
        self._preempt(victim, self._plan)
        return victim is request

    def running_in(self, slot: int) -> Request:
        for request in self.running:
            if request.slot == slot:
                return request
        raise KeyError(slot)

    def _schedule_waiting(self, plan: StepPlan, now: float) -> None:
        core, kv, policy = self.core, self.kv, self.policy
        if not (len(policy) and core.budget_open and self.slots.num_free > 0):
            return
        reserve = core.decode_reserve_blocks()
        while len(policy) and core.budget_open and self.slots.num_free > 0:
            request = policy.peek(now)
            if policy.admission_veto(request, self.running):
                return
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
            if hits:
                request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self._admit(plan, request, hits)
            core.schedule_admitted(request.slot, num_new_tokens, num_blocks)
            if swapped:
                self._swap_in(plan, request)
            reserve += core.reserve_blocks_of(request.slot, num_new_tokens)

    def _fits(self, request: Request) -> bool:
        """Whether the waiting request's first chunk could be admitted right now."""
        if len(self.running) >= self.max_num_seqs or self.slots.num_free == 0:
            return False
        if self.swap.held_blocks(request) is not None:
            hits, num_free_hits, num_cached = [], 0, request.num_computed_tokens
        else:
            hits, num_free_hits = self.kv.find_cached_prefix(request)
            num_cached = len(hits) * self.kv.block_size
        first_chunk = min(request.num_tokens - num_cached, self.config.max_num_batched_tokens,
                          self.config.max_prefill_chunk or sys.maxsize)
        num_blocks = cdiv(num_cached + first_chunk, self.kv.block_size) - len(hits)
        return num_blocks + num_free_hits <= self.kv.num_free_blocks

    def _preempt_for_waiting(self, plan: StepPlan, head: Optional[Request]) -> None:
        """Preempts running sequences the policy ranks below the head of the queue until the
        head fits (lowest rank first). FCFS-like policies never rank a waiting request above a
        running one, so for them this is never called (see _preempts_for_waiting)."""
        while head is not None and self.running and not self._fits(head):
            victim = self.policy.select_victim(self.running)
            if not self.policy.may_preempt_for(head, victim):
                return
            self._preempt(victim, plan)

    def _admit(self, plan: StepPlan, request: Request, hits: list[int]) -> None:
        request.status = RequestStatus.RUNNING
        request.slot = self.slots.allocate()
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        token_ids = request.all_token_ids
        plan.new_sequences.append(self._new_sequence(request, token_ids))
        request.block_ids = list(hits)
        self.core.admit(request.slot, request, token_ids, request.num_computed_tokens, hits,
                        len(request.prompt_token_ids) + request.stopping.max_new_tokens,
                        self.kv.salt(request), self._lookahead(request))
        self.running.append(request)

    def _lookahead(self, request: Request) -> int:
        """Draft tokens granted to each decode of `request`: the engine's k when it speculates
        and the request needs nothing per token that drafts would have to honour (logprobs,
        penalties, bias, min tokens, a grammar)."""
        k = self.facts.num_speculative_tokens
        if not k or request.logprobs is not None or request.structured is not None:
            return 0
        sampling, stopping = request.sampling, request.stopping
        if (sampling.repetition_penalty != 1.0 or sampling.presence_penalty
                or sampling.frequency_penalty or sampling.logit_bias or stopping.min_new_tokens):
            return 0
        return k

    def _new_sequence(self, request: Request, token_ids: list[int]) -> NewSequence:
        """How the model service learns of a sequence (at admission, resume or fork)."""
        stopping = request.stopping
        suppressed: tuple[int, ...] = ()
        if stopping.min_new_tokens:
            eos = () if stopping.ignore_eos else self.facts.eos_token_ids
            suppressed = tuple(sorted(set(eos) | stopping.stop_token_ids))
        # Prompt logprobs are asked for until every prompt position has one (a recompute after
        # a preemption mid-prompt asks again; entries already held are skipped on arrival).
        prompt_logprobs = request.prompt_logprobs
        if (prompt_logprobs is not None
                and len(request.prompt_logprobs_out) >= len(request.prompt_token_ids) - 1):
            prompt_logprobs = None
        return NewSequence(
            slot=request.slot, token_ids=token_ids, sampling=request.sampling,
            num_computed_tokens=request.num_computed_tokens,
            num_prompt_tokens=len(request.prompt_token_ids),
            min_new_tokens=stopping.min_new_tokens, min_tokens_suppressed_ids=suppressed,
            num_logprobs=request.logprobs, num_prompt_logprobs=prompt_logprobs,
            speculate=self._lookahead(request) > 0)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Preemption: free the device blocks, requeue ahead of fresh requests. By swap when the
        swap space has room for the sequence's computed KV (copied out before this step's
        forward; it resumes where it stopped, scheduler_service/core/swap.py), else by recompute
        (it starts over from its tokens). The model service drops the slot before this step
        runs (unless it never heard of it: a pending fork, always recomputed)."""
        slot = request.slot
        self.num_preemptions_total += 1
        known = self._pending_forks.pop(slot, None) is None
        if known:
            plan.preempted_slots.append(slot)
        # A sequence whose token is still in flight (overlap) has computed all its known tokens:
        # that token will never reach it, so its last known position is computed again on
        # resume, to sample it again; the KV before it is kept (plans run in order, so the one
        # in flight has written it before this plan's swap-out reads it).
        num_kept = min(request.num_computed_tokens, request.num_tokens - 1)
        num_swap_blocks = cdiv(num_kept, self.kv.block_size)
        by_swap = known and self.swap.can_swap_out(num_swap_blocks)
        if by_swap:
            plan.swap_out_src.extend(self.core.block_ids(slot)[:num_swap_blocks])
            plan.swap_out_dst.extend(self.swap.swap_out(request, num_swap_blocks))
            request.num_computed_tokens = num_kept
        self.running.remove(request)
        self._free_blocks(request)
        self.slots.free(slot)
        request.slot = None
        if not by_swap:
            request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.policy.add_preempted(request)

    def _free_blocks(self, request: Request) -> None:
        if request.slot is not None:  # running: its blocks are in the core's slot
            self.core.release(request.slot)
        else:  # waiting: it may hold swap blocks
            self.swap.discard(request)
        request.block_ids = []

    def _swap_in(self, plan: StepPlan, request: Request) -> None:
        """A swapped-out request just admitted: its first blocks are filled from swap space
        before the forward (its block table was sent whole with this plan)."""
        host = self.swap.swap_in(request)
        plan.swap_in_src.extend(host)
        plan.swap_in_dst.extend(request.block_ids[:len(host)])

    def _usable_swap_blocks(self, facts: EngineFacts) -> int:
        if self.config.preemption_mode == "recompute":
            return 0
        return facts.num_swap_blocks

    def _expire_deadlines(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._end(request, FinishReason.DEADLINE, self._finished_slots)

    def _collect_aborts(self) -> None:
        for request_id in self._abort_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._end(request, FinishReason.CANCELLED, self._aborted_slots)
        self._abort_ids.clear()

    def _end(self, request: Request, reason: FinishReason, lifecycle: list[int]) -> None:
        """Ends a request for a reason outside its tokens: out of the queue, blocks freed."""
        if request.status is RequestStatus.WAITING:
            self.policy.remove(request)
        else:
            self.running.remove(request)
        self._early_outputs.append((request, self.outputs.finish(request, reason)))
        self._early_outputs.extend((request, output) for output in request.unforked_finals(reason))
        request.forked = True
        self._release(request, lifecycle)

    def _release(self, request: Request, lifecycle: list[int]) -> None:
        self._free_blocks(request)
        if request.slot is not None:
            self.slots.free(request.slot)
            if self._pending_forks.pop(request.slot, None) is None:
                lifecycle.append(request.slot)  # the model service knows the slot
            request.slot = None
        request.status = RequestStatus.FINISHED
        if request.guide is not None:
            self._num_constrained -= 1
        self.outputs.release(request)
        self.policy.on_finished(request)
        del self.requests[request.request_id]
        members = self._groups.get(request.public_id)
        if members and members[0].forked and all(m.is_finished for m in members):
            del self._groups[request.public_id]

    def update(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, RequestOutput]]:
        """Applies a step's result: computed counts advance and full blocks enter the prefix
        cache (both in C, for every sequence in the plan), then the sequences that sampled
        tokens get them appended, stops checked, and free their blocks when finished."""
        outputs: list[tuple[Request, RequestOutput]] = []
        self.num_draft_tokens_total += result.num_draft_tokens
        self.num_accepted_draft_tokens_total += result.num_accepted_draft_tokens
        if result.prompt_logprobs:
            self._take_prompt_logprobs(plan, result)
        indices, offsets = self.core.advance(plan.packed, result.num_sampled_tokens)
        if not indices:
            return outputs
        now = time.monotonic()
        requests, counts, sampled = plan.requests, result.num_sampled_tokens, \
            result.sampled_token_ids
        logprobs = LogprobReader(result.logprobs, result.logprob_token_ids)
        for index, offset in zip(indices, offsets):
            request = requests[index]
            token_ids = sampled[offset:offset + counts[index]]
            entries = None
            if request.logprobs is not None:
                entries = logprobs.take(token_ids, request.logprobs)
            output = self._take_tokens(request, token_ids, entries, now)
            if output is not None:
                outputs.append((request, output))
        return outputs

    def _take_tokens(self, request: Request, token_ids: list[int], entries,
                     now: float, placeholder: Optional[int] = None) -> Optional[RequestOutput]:
        """A request's sampled tokens: stops checked, appended (or, with `placeholder`, the
        index of the token overlap's commit reserved, set), forks started, released when
        finished. Returns what the client gets (None: held back by stream_interval)."""
        if request.first_token_time is None:
            request.first_token_time = now
        output = self.outputs.add_tokens(request, token_ids, entries)
        if placeholder is None:
            self.core.append_tokens(request.slot, output.token_ids)
        elif output.token_ids:
            self.core.set_token(request.slot, placeholder, output.token_ids[0])
        if request.stream_interval > 1:
            output = self.outputs.coalesce(request, output)  # None: held back
        if not request.forked and request.n > 1:
            self._fork_samples(request)
        if request.finish_reason is not None:
            self.running.remove(request)
            self._release(request, self._finished_slots)
        return output

    # ---- overlap: the next plan is built while the model service computes this one ---------

    @property
    def needs_lockstep(self) -> bool:
        """A plan can only be built once the previous one's tokens are known: a grammar's mask
        depends on them, and a speculating decode's length does."""
        return self._num_constrained > 0 or self.facts.num_speculative_tokens > 0

    def commit(self, plan: StepPlan) -> None:
        """Applies a plan as if it had completed, before its result: computed counts advance and
        every entry that samples gets a placeholder token (its id is on the model side, which
        feeds it to the next step by itself), so the next plan can be built right away.
        Prefix-cache registration waits for reconcile(), when the ids are real."""
        if plan.packed is None:
            raise ValueError("commit needs a plan built by schedule()")
        plan.prompt_starts = {index: request.num_computed_tokens
                              for index, request in enumerate(plan.requests)
                              if request.prompt_logprobs is not None}
        expected = self.core.sampling_entries(plan.packed)
        self.core.advance(plan.packed, expected, cache_blocks=False)
        placeholders = {}
        for index in self.core.live_entries(plan.packed):
            if expected[index]:
                slot = plan.slots[index]
                placeholders[index] = self.core.num_tokens(slot)
                self.core.append_tokens(slot, [0])
        plan.placeholders = placeholders

    def reconcile(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, RequestOutput]]:
        """The result of a committed plan: real token ids replace the placeholders, stops are
        checked (a request that stopped here was already scheduled in the next plan: that
        token is discarded when its result comes, the slot having been released), blocks
        enter the prefix cache. Entries whose sequence left its slot since (preempted, aborted)
        are skipped; a preempted one recomputes and samples that token again."""
        outputs: list[tuple[Request, RequestOutput]] = []
        if result.prompt_logprobs:
            self._take_prompt_logprobs(plan, result, plan.prompt_starts)
        live = set(self.core.live_entries(plan.packed))
        now = time.monotonic()
        logprobs = LogprobReader(result.logprobs, result.logprob_token_ids)
        offset = 0
        for index, count in enumerate(result.num_sampled_tokens):
            if not count:
                continue
            request = plan.requests[index]
            token_ids = result.sampled_token_ids[offset:offset + count]
            offset += count
            entries = None
            if request.logprobs is not None:
                entries = logprobs.take(token_ids, request.logprobs)
            if index not in live or index not in plan.placeholders:
                continue
            output = self._take_tokens(request, token_ids, entries, now,
                                       placeholder=plan.placeholders[index])
            if output is not None:
                outputs.append((request, output))
        self.core.cache_blocks(plan.packed)
        return outputs

    def _take_prompt_logprobs(self, plan: StepPlan, result: StepResult,
                              starts: Optional[dict[int, int]] = None) -> None:
        """Files the step's prompt logprobs under their requests (before advance() moves the
        computed counts: an entry's position follows from the count at planning time)."""
        reader = LogprobReader(result.prompt_logprobs, result.prompt_logprob_token_ids)
        for index, request in enumerate(plan.requests):
            if request.prompt_logprobs is None or request.index:
                continue
            num_prompt = len(request.prompt_token_ids)
            # Position of the chunk's first token (recorded at commit when the plan ran ahead).
            start = request.num_computed_tokens if starts is None else starts[index]
            end = min(start + plan.num_scheduled_tokens[index], num_prompt - 1)
            if end <= start:
                continue
            targets = request.prompt_token_ids[start + 1:end + 1]
            entries = reader.take(targets, request.prompt_logprobs)
            # After a recompute, positions already held come again: keep the first copy.
            have = len(request.prompt_logprobs_out)
            request.prompt_logprobs_out.extend(entries[max(0, have - start):])

    # ---- parallel samples (n > 1) ---------------------------------------------------------

    def _fork_samples(self, parent: Request) -> None:
        """Samples 1 .. n-1 of a request whose prompt is computed (it just drew its first
        token). Each shares the parent's prompt blocks and recomputes only the last prompt
        token, to draw its own first token with its own seed; the block that token lands in
        is copied first when the parent already wrote into it (copy-on-write). A sample that
        finds no free slot or block waits in the queue like a fresh request (and then finds
        the prompt in the prefix cache)."""
        parent.forked = True
        members = self._groups.setdefault(parent.request_id, [parent])
        num_prompt_tokens = len(parent.prompt_token_ids)
        needs_copy = (num_prompt_tokens - 1) % self.kv.block_size != 0
        for index in range(1, parent.n):
            child = parent.fork_sample(index)
            self.requests[child.request_id] = child
            members.append(child)
            self.outputs.start(child)
            if child.guide is not None:
                self._num_constrained += 1
            if child.deadline is not None:
                heapq.heappush(self._deadlines, (child.deadline, child.request_id))
            if (self.slots.num_free and len(self.running) < self.max_num_seqs
                    and (self.kv.num_free_blocks > 0 or not needs_copy)):
                self._start_fork(parent, child)
            else:
                self.policy.add(child)

    def _start_fork(self, parent: Request, child: Request) -> None:
        num_prompt_tokens = len(parent.prompt_token_ids)
        num_computed = num_prompt_tokens - 1
        child.status = RequestStatus.RUNNING
        child.slot = self.slots.allocate()
        child.first_scheduled_time = time.monotonic()
        child.block_ids = parent.block_ids[:num_computed // self.kv.block_size]
        copy = self.core.fork(parent.slot, child.slot, child, num_prompt_tokens,
                              num_prompt_tokens + child.stopping.max_new_tokens)
        child.num_computed_tokens = child.num_cached_tokens = num_computed
        self._pending_forks[child.slot] = (
            self._new_sequence(child, list(child.prompt_token_ids)), copy)
        self.running.append(child)

    def _register_forks(self, plan: StepPlan) -> None:
        """Forked samples still running join the plan: registered, their copy before the
        forward. (Done last, so that a sample preempted in this very step is never sent.)"""
        for slot, (sequence, copy) in self._pending_forks.items():
            plan.new_sequences.append(sequence)
            if copy is not None:
                plan.copy_src.append(copy[0])
                plan.copy_dst.append(copy[1])
        for request in self.running:
            if request.slot in self._pending_forks:
                self._pending_forks.clear()


class LogprobReader:
    """Walks a step's flat logprob arrays: per token, its logprob then k alternatives (with k
    ids in the id array), k being the asking sequence's count."""

    def __init__(self, values: list[float], token_ids: list[int]):
        self._values, self._ids = values, token_ids
        self._value_at = self._id_at = 0

    def take(self, token_ids: list[int], k: int) -> list[TokenLogprob]:
        entries = []
        values, ids = self._values, self._ids
        for token_id in token_ids:
            v, i = self._value_at, self._id_at
            top = tuple(zip(ids[i:i + k], values[v + 1:v + 1 + k]))
            entries.append(TokenLogprob(token_id, values[v], top))
            self._value_at, self._id_at = v + 1 + k, i + k
        return entries
