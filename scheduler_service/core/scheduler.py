"""The scheduler: one token budget per step, shared by everything that has tokens to compute.

Requests are added and aborted from the serving layer; `schedule()` builds the next step's plan
and `update()` applies the model service's result to it. Both run on the event loop thread, one
step at a time, so no locking is needed.

Split by lifecycle: this module has the requests' arrival, the step (schedule) and its result
(update); departures.py ends requests and frees what they held, waiting.py admits waiting ones
(lora_admission.py: the adapter rule), preemption.py makes room, forks.py starts parallel
samples, overlap.py commits and reconciles plans built ahead.

Python keeps the orchestration: Request objects and their lifecycle (admit, finish, abort,
deadline, outputs), the waiting queue and every policy decision. The loops over running sequences
(budget, chunking, block allocation, the plan's packed arrays, computed counts and prefix hashes
in update) run in cython_ext/step_core.pyx, called a few times per step. The pure-Python oracle
of the same decisions is tests/scheduler/oracle_scheduler.py.
"""

from __future__ import annotations

import heapq
import time
from typing import Optional

import structlog

from cython_ext.step_core import PHASE_ALL, PHASE_DECODES, PHASE_PREFILLS, StepCore
from scheduler_service.config import SchedulerConfig
from scheduler_service.core import policies
from scheduler_service.core.departures import Departures
from scheduler_service.core.forks import ParallelSamples
from scheduler_service.core.kv_blocks import KVBlockManager
from scheduler_service.core.lora_admission import LoraAdmission
from scheduler_service.core.loras import LoraState
from scheduler_service.core.overlap import LogprobReader, Overlap
from scheduler_service.core.plan import NewSequence, StepPlan, StepResult
from scheduler_service.core.policies.base import SchedulingPolicy
from scheduler_service.core.preemption import Preemption
from scheduler_service.core.request import Request, RequestOutput, RequestStatus, TokenLogprob
from scheduler_service.core.slots import SlotAllocator
from scheduler_service.core.swap import SwapSpace
from scheduler_service.core.waiting import WaitingAdmission
from scheduler_service.engine.client import EngineFacts
from scheduler_service.text import structured
from scheduler_service.text.outputs import OutputProcessor

log = structlog.get_logger(__name__)


def step_budget(config: SchedulerConfig, facts: EngineFacts) -> tuple[int, int]:
    """(max_num_seqs, token budget) of every step: the config's where set, else the engine's
    step shape (EngineFacts.step_max_seqs, step_token_budget); sequences never above the slots
    the engine holds."""
    max_seqs = config.max_num_seqs if config.max_num_seqs is not None else facts.step_max_seqs
    tokens = config.max_num_batched_tokens
    budget = tokens if tokens is not None else facts.step_token_budget
    return min(max_seqs, facts.max_num_slots), budget


def log_step_budget(scheduler: "Scheduler") -> None:
    """The step budget in force, and whether the config or the engine chose it, at start."""
    config = scheduler.config
    log.info(
        "step_budget",
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.token_budget,
        seqs_from="config" if config.max_num_seqs is not None else "engine",
        tokens_from="config" if config.max_num_batched_tokens is not None else "engine",
        device=scheduler.facts.device,
    )


class Scheduler(Departures, WaitingAdmission, LoraAdmission, Preemption, ParallelSamples, Overlap):
    def __init__(
        self,
        config: SchedulerConfig,
        facts: EngineFacts,
        outputs: OutputProcessor,
        policy: Optional[SchedulingPolicy] = None,
    ):
        self.config = config
        self.facts = facts
        self.outputs = outputs
        self.kv = KVBlockManager(
            facts.num_kv_blocks,
            facts.block_size,
            config.enable_prefix_caching,
            config.prefix_cache_scope,
        )
        self.slots = SlotAllocator(facts.max_num_slots)
        # Host blocks for preemption by swap (none when preempting by recompute).
        self.swap = SwapSpace(self._usable_swap_blocks(facts))
        # The step's budget: the config's where a flag set it, else the engine's choice for its
        # device (Describe); reset_engine takes a restarted engine's.
        self.max_num_seqs, self.token_budget = step_budget(config, facts)
        self.policy = policy or policies.create(
            config.policy, prefix_match_len=self.kv.num_cached_prefix_tokens
        )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.loras = LoraState(facts.lora)  # adapter counts and residency (core/loras.py)
        self._next_step_id = 1
        self.num_preemptions_total = 0
        self.num_draft_tokens_total = 0  # speculation, as the engine reports it
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
            policy_type.may_preempt_for is not SchedulingPolicy.may_preempt_for
        )
        self._plan: Optional[StepPlan] = None
        # Requests in flight with structured output: only then are the plans' masks filled.
        self._num_constrained = 0
        # The waiting queue's tokens to compute, and when they were summed (the next step id,
        # the queue's length): core/waiting.py, num_waiting_tokens.
        self._waiting_tokens: tuple[tuple[int, int], int] = ((0, 0), 0)

    def _new_core(self) -> StepCore:
        return StepCore(
            self.kv.pool,
            self.facts.block_size,
            self.facts.max_num_slots,
            max_prefill_chunk=self.config.max_prefill_chunk,
            decode_reserve_tokens=self.config.decode_reserve_tokens,
            enable_prefix_caching=self.config.enable_prefix_caching,
            on_blocks_exhausted=self._on_blocks_exhausted,
            # The base class's on_scheduled does nothing: skip 256 calls per step for it.
            on_scheduled=(
                None
                if type(self.policy).on_scheduled is SchedulingPolicy.on_scheduled
                else self.policy.on_scheduled
            ),
        )

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
        self.kv.replace_pool(facts.num_kv_blocks)
        self.slots = SlotAllocator(facts.max_num_slots)
        self.max_num_seqs, self.token_budget = step_budget(self.config, facts)
        self.swap = SwapSpace(self._usable_swap_blocks(facts))
        self.core = self._new_core()
        self.loras.reset(facts.lora)  # the new process holds no adapter
        return num_running

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
        self._enqueue_counted(request)

    def _enqueue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.loras.on_arrive(request.lora_name)
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
        return bool(
            self.running
            or len(self.policy)
            or self._finished_slots
            or self._aborted_slots
            or self._abort_ids
            or self._early_outputs  # e.g. requests of an adapter that failed to load
        )

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
            raise ValueError(
                f"request {request.request_id!r} is {request.status.name}, not waiting"
            )
        self.policy.remove(request)
        del self.requests[request.request_id]
        self.loras.on_leave(request.lora_name)
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
        catching up with its num_tokens. One budget of token_budget and max_num_seqs (the
        config's max_num_batched_tokens and max_num_seqs, else the engine's) is shared by
        everyone:
          1. running sequences first: a decode takes 1 token, an unfinished prompt its next
             chunk (at most max_prefill_chunk tokens);
          2. then waiting sequences in the policy's order, chunked to what is left; a prefix
             cache hit starts them at the cached length; one is admitted only if every running
             sequence keeps decode_reserve_tokens of room to grow;
          3. when blocks run out for a running sequence, the policy's victim is preempted
             (blocks freed, requeued ahead of fresh requests of equal rank; by swap when the
             swap space holds its KV, else by recompute) until it fits; a policy that ranks
             requests (priority) also preempts lower-ranked running
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
            self._preempt_for_waiting(plan, self.policy.peek(now))

        core = self.core
        core.begin_step(plan.step_id, self.token_budget, self.max_num_seqs)
        self._schedule_in_mode_order(plan, now)
        (
            plan.requests,
            plan.slots,
            plan.num_scheduled_tokens,
            plan.num_new_blocks,
            plan.new_block_ids,
            plan.packed,
        ) = core.end_step()
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

    def _schedule_in_mode_order(self, plan: StepPlan, now: float) -> None:
        """Steps 1 and 2 in the chunking mode's order (SchedulerConfig.chunking_mode)."""
        core, mode = self.core, self.config.chunking_mode
        self._lora_park(plan.step_id)  # out-of-turn adapters' sequences sit the step out
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

    # ---- the step's result --------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, RequestOutput]]:
        """Applies a step's result: computed counts advance and full blocks enter the prefix
        cache (both in C, for every sequence in the plan), then the sequences that sampled
        tokens get them appended, stops checked, and free their blocks when finished."""
        outputs: list[tuple[Request, RequestOutput]] = []
        self.loras.completed_step = plan.step_id  # its released slots are gone on the model side
        self.num_draft_tokens_total += result.num_draft_tokens
        self.num_accepted_draft_tokens_total += result.num_accepted_draft_tokens
        if result.prompt_logprobs:
            self._take_prompt_logprobs(plan, result)
        if plan.packed is None:
            raise ValueError("update needs a plan built by schedule()")
        indices, offsets = self.core.advance(plan.packed, result.num_sampled_tokens)
        if not indices:
            return outputs
        now = time.monotonic()
        requests, counts, sampled = (
            plan.requests,
            result.num_sampled_tokens,
            result.sampled_token_ids,
        )
        logprobs = LogprobReader(result.logprobs, result.logprob_token_ids)
        for index, offset in zip(indices, offsets):
            request = requests[index]
            token_ids = sampled[offset : offset + counts[index]]
            entries = None
            if request.logprobs is not None:
                entries = logprobs.take(token_ids, request.logprobs)
            output = self._take_tokens(request, token_ids, entries, now)
            if output is not None:
                outputs.append((request, output))
        return outputs

    def _take_tokens(
        self,
        request: Request,
        token_ids: list[int],
        entries: Optional[list[TokenLogprob]],
        now: float,
        placeholder: Optional[int] = None,
    ) -> Optional[RequestOutput]:
        """A request's sampled tokens: stops checked, appended (or, with `placeholder`, the
        index of the token overlap's commit reserved, set), forks started, released when
        finished. Returns what the client gets (None: held back by stream_interval)."""
        if request.first_token_time is None:
            request.first_token_time = now
        accepted, shown = self.outputs.take_tokens(request, token_ids, entries)
        if placeholder is None:
            self.core.append_tokens(request.running_slot, accepted)
        elif accepted:
            self.core.set_token(request.running_slot, placeholder, accepted[0])
        if not request.forked and request.n > 1:
            self._fork_samples(request)
        if request.finish_reason is not None:
            if placeholder is not None:
                # Overlap registers a plan's blocks once its stops are checked, after this
                # release: a sequence finishing here registers its own first (its prompt's, when
                # it ends in its first step), up to its last real token.
                num_real = placeholder + (1 if accepted else 0)
                self.core.cache_finished_blocks(request.running_slot, num_real)
            self.running.remove(request)
            self.loras.on_stop(request.lora_name, self._next_step_id)
            self._release(request, self._finished_slots)
        return shown
