"""Pure-Python oracle of the scheduler's step rule (tests only): the same decisions as
scheduler_service.core.scheduler.Scheduler, written plainly and independent of the Cython code.

This is the Python scheduler as it was before the hot path moved into cython_ext/step_core.pyx:
per-request block tables in Python lists, the pure-Python block pool of block_pool_oracle.py and
its pure-Python hash. test_golden_parity.py drives both with the same workloads and the same fake
results and compares every plan field by field, step by step, and the final block pools.
bench/bench_schedule.py times both.

Its requests' computed counts and block tables live in Python: each request is bound, for its
whole life here, to an OracleSlotFacts (Request.slot_view) that this file writes.

One deliberate change from the original: `_schedule_running` skips a request already scheduled in
this step. Without it, prefill-first could schedule a decode twice in one plan when it was
preempted by a prompt chunk and re-admitted from the queue in the same step (the Cython core
skips it too).
"""
from __future__ import annotations

import dataclasses
import hashlib
import heapq
import sys
import time
from typing import Iterable, Optional

from block_pool_oracle import OracleBlockPool, block_hash
from scheduler_service.core import policies
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine.client import EngineFacts
from scheduler_service.text.outputs import OutputProcessor
from scheduler_service.core.plan import NewSequence, StepPlan, StepResult
from scheduler_service.core.policies.base import SchedulingPolicy
from scheduler_service.core.request import FinishReason, Request, RequestOutput, RequestStatus


@dataclasses.dataclass
class OracleSlotFacts:
    """A request's computed count and block table, kept in Python (what the StepCore owns for
    the native scheduler); satisfies request.SlotFacts."""

    num_computed_tokens: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)


def facts_of(request: Request) -> OracleSlotFacts:
    facts = request.slot_view
    assert isinstance(facts, OracleSlotFacts), request.request_id
    return facts


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def salt_of(cache_salt: str) -> int:
    """The global-scope 256-bit salt: 0 for no cache_salt, else SHA-256 of b"C" len cache_salt."""
    if not cache_salt:
        return 0
    raw = cache_salt.encode()
    return int.from_bytes(hashlib.sha256(b"C" + len(raw).to_bytes(4, "little") + raw).digest(), "big")


class OracleKVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = OracleBlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Prefix-cache hashes of each request's full blocks, parallel to its block_ids.
        self.hashes: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        """Every block but the reserved block 0."""
        return self.pool.num_usable

    @property
    def capacity_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to append so that the request can hold `num_new_tokens` more computed tokens."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(cdiv(num_tokens, self.block_size) - len(request.block_ids), 0)

    def can_allocate(self, num_blocks: int) -> bool:
        return self.pool.can_allocate(num_blocks)

    def allocate(self, request: Request, num_blocks: int) -> list[int]:
        new_block_ids = self.pool.allocate(num_blocks) if num_blocks else []
        facts_of(request).block_ids.extend(new_block_ids)
        return new_block_ids

    # ---- prefix caching -------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the start of a request that holds no block yet.

        Returns (block ids, how many of them sit in the free queue, i.e. would stop being free
        once taken). The last token is never matched: a step must compute at least one token
        to sample from, and it must not write into a shared block.
        """
        if not self.enable_prefix_caching:
            return [], 0
        token_ids = request.all_token_ids
        hits = self.pool.match_prefix(token_ids[:len(token_ids) - 1], self.block_size,
                                      salt_of(request.cache_salt))
        return hits, sum(1 for block in hits if self.pool.ref_count(block) == 0)

    def take_cached_prefix(self, request: Request, hits: list[int]) -> None:
        """Shares the hit blocks with the request; their tokens count as computed."""
        self.pool.incref(hits)
        num_tokens = len(hits) * self.block_size
        facts_of(request).block_ids = list(hits)
        # The request's next blocks chain on the hashes of these.
        self.hashes[request.request_id] = self.pool.block_hashes(
            request.all_token_ids[:num_tokens], self.block_size, salt_of(request.cache_salt))
        facts_of(request).num_computed_tokens = num_tokens

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens a waiting request would find cached (the `lpm` policy's key)."""
        hits, _ = self.find_cached_prefix(request)
        return len(hits) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Registers every block of the request that is full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        hashes = self.hashes.setdefault(request.request_id, [])
        if num_full <= len(hashes):
            return
        token_ids = request.all_token_ids
        salt = salt_of(request.cache_salt)
        parent = hashes[-1] if hashes else 0
        for index in range(len(hashes), num_full):
            start = index * self.block_size
            parent = block_hash(parent, token_ids[start:start + self.block_size], salt)
            self.pool.cache_block(request.block_ids[index], parent)
            hashes.append(parent)

    def free(self, request: Request) -> None:
        facts = facts_of(request)
        if facts.block_ids:
            self.pool.free(facts.block_ids)
            facts.block_ids = []
        self.hashes.pop(request.request_id, None)


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


@dataclasses.dataclass
class _Budget:
    """What is left of one step."""

    tokens: int
    seqs: int
    prefill_chunks: int  # prompt chunks still allowed (1 per step in decode-priority mode)
    stalled: bool = False  # a running sequence had to preempt itself: admit nobody


class OracleScheduler:
    def __init__(self, config: SchedulerConfig, facts: EngineFacts, outputs: OutputProcessor,
                 policy: Optional[SchedulingPolicy] = None):
        self.config = config
        self.facts = facts
        self.outputs = outputs
        self.kv = OracleKVBlockManager(facts.num_kv_blocks, facts.block_size,
                                 config.enable_prefix_caching)
        self.slots = SlotAllocator(facts.max_num_slots)
        # The config's step budget where set, else the engine's step shape (Describe).
        seqs = config.max_num_seqs if config.max_num_seqs is not None else facts.step_max_seqs
        self.max_num_seqs = min(seqs, facts.max_num_slots)
        self.token_budget = (config.max_num_batched_tokens if config.max_num_batched_tokens is not None
                             else facts.step_token_budget)
        self.policy = policy or policies.create(
            config.policy, prefix_match_len=self.kv.num_cached_prefix_tokens)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._next_step_id = 1
        self._abort_ids: set[str] = set()
        self._deadlines: list[tuple[float, str]] = []  # a heap
        # Lifecycle news for the model service, sent with the next plan.
        self._finished_slots: list[int] = []
        self._aborted_slots: list[int] = []
        # Outputs decided by schedule() itself (aborts, deadlines), delivered with the step's own.
        self._early_outputs: list[tuple[Request, RequestOutput]] = []
        # Parallel samples: every sample by public id; forks not yet sent, by slot.
        self._groups: dict[str, list[Request]] = {}
        self._pending_forks: dict[int, tuple[NewSequence, Optional[tuple[int, int]]]] = {}
        # Forked samples whose block table the model service has not seen yet.
        self._unsent_tables: set[int] = set()

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise KeyError(request.request_id)
        request.slot_view = OracleSlotFacts()
        self.requests[request.request_id] = request
        self.outputs.start(request)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))
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
        members = self._groups.get(request_id)
        return members[0] if members else self.requests.get(request_id)

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
             (recompute: blocks freed, requeued ahead of fresh requests of equal rank) until it
             fits; a policy that ranks requests (priority) also preempts lower-ranked running
             sequences for the head of the queue.
        The chunking mode only changes the order of 1 and 2 (see SchedulerConfig).
        Aborted requests and passed deadlines leave first, freeing their blocks in this step.
        """
        now = time.monotonic()
        self._expire_deadlines(now)
        self._collect_aborts()
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        self._preempt_for_waiting(plan, now)

        budget = _Budget(tokens=self.token_budget, seqs=self.max_num_seqs,
                         prefill_chunks=sys.maxsize)
        mode = self.config.chunking_mode
        if mode == "interleaved":
            self._schedule_running(plan, budget, list(self.running))
            self._schedule_waiting(plan, budget, now)
        elif mode == "prefill-first":
            decodes = [r for r in self.running if r.num_tokens_to_compute == 1]
            self._schedule_running(
                plan, budget, [r for r in self.running if r.num_tokens_to_compute > 1])
            self._schedule_waiting(plan, budget, now)
            self._schedule_running(plan, budget, decodes)
        else:  # decode-priority
            prefills = [r for r in self.running if r.num_tokens_to_compute > 1]
            self._schedule_running(
                plan, budget, [r for r in self.running if r.num_tokens_to_compute == 1])
            budget.prefill_chunks = 1
            self._schedule_running(plan, budget, prefills)
            self._schedule_waiting(plan, budget, now)

        for slot, (sequence, copy) in self._pending_forks.items():
            plan.new_sequences.append(sequence)
            if copy is not None:
                plan.copy_src.append(copy[0])
                plan.copy_dst.append(copy[1])
        self._pending_forks.clear()
        plan.finished_slots, self._finished_slots = self._finished_slots, []
        plan.aborted_slots, self._aborted_slots = self._aborted_slots, []
        return plan

    def _chunk(self, num_tokens_to_compute: int, budget: _Budget) -> int:
        """Tokens a sequence may compute this step: a decode 1, a prompt its next chunk."""
        if num_tokens_to_compute <= 1:
            return min(num_tokens_to_compute, budget.tokens)
        if budget.prefill_chunks <= 0:
            return 0
        cap = self.config.max_prefill_chunk or sys.maxsize
        return min(num_tokens_to_compute, budget.tokens, cap)

    def _schedule_running(self, plan: StepPlan, budget: _Budget,
                          requests: Iterable[Request]) -> None:
        scheduled = {id(r) for r in plan.requests}
        for request in requests:
            if budget.tokens <= 0 or budget.seqs <= 0 or budget.stalled:
                return
            if request.status is not RequestStatus.RUNNING or id(request) in scheduled:
                continue  # preempted earlier in this step (and maybe re-admitted)
            num_new_tokens = self._chunk(request.num_tokens_to_compute, budget)
            if num_new_tokens == 0:
                continue
            num_blocks = self.kv.num_blocks_needed(request, num_new_tokens)
            while not self.kv.can_allocate(num_blocks):
                victim = self.policy.select_victim(
                    [r for r in self.running if id(r) not in scheduled])
                self._preempt(victim, plan)
                if victim is request:
                    budget.stalled = True  # nothing else fits either
                    return
            self._schedule(plan, budget, request, num_new_tokens, num_blocks)
            scheduled.add(id(request))

    def _schedule_waiting(self, plan: StepPlan, budget: _Budget, now: float) -> None:
        reserve = self._decode_reserve_blocks(plan)
        while (len(self.policy) and budget.tokens > 0 and budget.seqs > 0
               and self.slots.num_free > 0 and not budget.stalled):
            request = self.policy.peek(now)
            if self.policy.admission_veto(request, self.running):
                return
            hits, num_free_hits = self.kv.find_cached_prefix(request)
            num_cached = len(hits) * self.kv.block_size
            num_new_tokens = self._chunk(request.num_tokens - num_cached, budget)
            if num_new_tokens == 0:
                return
            num_blocks = cdiv(num_cached + num_new_tokens, self.kv.block_size) - len(hits)
            if num_blocks + num_free_hits + reserve > self.kv.num_free_blocks:
                return  # wait for room rather than overtake (the policy's order holds)
            self.policy.pop(now)
            if hits:
                self.kv.take_cached_prefix(request, hits)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self._admit(plan, request)
            self._schedule(plan, budget, request, num_new_tokens, num_blocks, admitted=True)
            reserve += self._reserve_blocks_of(request, num_new_tokens)

    def _reserve_blocks_of(self, request: Request, num_scheduled: int) -> int:
        """Blocks the request needs to grow decode_reserve_tokens past this step (capped by its
        maximum length)."""
        max_tokens = len(request.prompt_token_ids) + request.stopping.max_new_tokens
        grown = min(max_tokens, request.num_computed_tokens + num_scheduled
                    + self.config.decode_reserve_tokens)
        return max(cdiv(grown, self.kv.block_size) - len(request.block_ids), 0)

    def _decode_reserve_blocks(self, plan: StepPlan) -> int:
        scheduled = {id(r): n for r, n in zip(plan.requests, plan.num_scheduled_tokens)}
        return sum(self._reserve_blocks_of(r, scheduled.get(id(r), 0)) for r in self.running)

    def _fits(self, request: Request) -> bool:
        """Whether the waiting request's first chunk could be admitted right now."""
        if len(self.running) >= self.max_num_seqs or self.slots.num_free == 0:
            return False
        hits, num_free_hits = self.kv.find_cached_prefix(request)
        num_cached = len(hits) * self.kv.block_size
        first_chunk = min(request.num_tokens - num_cached, self.token_budget,
                          self.config.max_prefill_chunk or sys.maxsize)
        num_blocks = cdiv(num_cached + first_chunk, self.kv.block_size) - len(hits)
        return num_blocks + num_free_hits <= self.kv.num_free_blocks

    def _preempt_for_waiting(self, plan: StepPlan, now: float) -> None:
        """Preempts running sequences the policy ranks below the head of the queue until the
        head fits (lowest rank first). FCFS-like policies never rank a waiting request above a
        running one, so for them this does nothing."""
        head = self.policy.peek(now) if len(self.policy) else None
        while head is not None and self.running and not self._fits(head):
            victim = self.policy.select_victim(self.running)
            if not self.policy.may_preempt_for(head, victim):
                return
            self._preempt(victim, plan)

    def _admit(self, plan: StepPlan, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.slot = self.slots.allocate()
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        plan.new_sequences.append(NewSequence(
            slot=request.slot, token_ids=request.all_token_ids, sampling=request.sampling,
            num_computed_tokens=request.num_computed_tokens,
            num_prompt_tokens=len(request.prompt_token_ids)))
        self.running.append(request)

    def _schedule(self, plan: StepPlan, budget: _Budget, request: Request,
                  num_new_tokens: int, num_blocks: int, admitted: bool = False) -> None:
        new_block_ids = self.kv.allocate(request, num_blocks)
        if admitted or id(request) in self._unsent_tables:
            self._unsent_tables.discard(id(request))
            # A new sequence's block table starts empty on the model side: send all of its
            # blocks, prefix-cache hits first.
            new_block_ids = request.block_ids
        plan.requests.append(request)
        plan.slots.append(request.slot)
        plan.num_scheduled_tokens.append(num_new_tokens)
        plan.num_new_blocks.append(len(new_block_ids))
        plan.new_block_ids.extend(new_block_ids)
        budget.tokens -= num_new_tokens
        budget.seqs -= 1
        if request.num_tokens_to_compute > 1:
            budget.prefill_chunks -= 1
        self.policy.on_scheduled(request, num_new_tokens)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Recompute preemption: free everything, requeue ahead of fresh requests; the model
        service drops the slot before this step runs (unless it never heard of it)."""
        slot = request.slot
        if self._pending_forks.pop(slot, None) is None:
            plan.preempted_slots.append(slot)
        self._unsent_tables.discard(id(request))
        self.running.remove(request)
        self.kv.free(request)
        self.slots.free(slot)
        request.slot = None
        facts_of(request).num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.policy.add_preempted(request)

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
        self.kv.free(request)
        self._unsent_tables.discard(id(request))
        if request.slot is not None:
            self.slots.free(request.slot)
            if self._pending_forks.pop(request.slot, None) is None:
                lifecycle.append(request.slot)
            request.slot = None
        request.status = RequestStatus.FINISHED
        self.outputs.release(request)
        self.policy.on_finished(request)
        del self.requests[request.request_id]
        members = self._groups.get(request.public_id)
        if members and members[0].forked and all(m.is_finished for m in members):
            del self._groups[request.public_id]

    def update(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, RequestOutput]]:
        """Applies a step's result: computed counts advance, full blocks enter the prefix
        cache, sampled tokens are appended, stops are checked, finished requests free their
        blocks."""
        outputs: list[tuple[Request, RequestOutput]] = []
        now = time.monotonic()
        offset = 0
        for request, num_scheduled, num_sampled in zip(
                plan.requests, plan.num_scheduled_tokens, result.num_sampled_tokens):
            token_ids = result.sampled_token_ids[offset:offset + num_sampled]
            offset += num_sampled
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted, expired or preempted after this plan was built
            facts_of(request).num_computed_tokens += num_scheduled
            self.kv.cache_full_blocks(request)
            if not token_ids:
                continue  # a prompt chunk that did not reach the end yet
            if request.first_token_time is None:
                request.first_token_time = now
            _, output = self.outputs.take_tokens(request, token_ids)
            if not request.forked and request.n > 1:
                self._fork_samples(request)
            if request.finish_reason is not None:
                self.running.remove(request)
                self._release(request, self._finished_slots)
            if output is not None:  # None: held back by stream_interval
                outputs.append((request, output))
        return outputs

    def _fork_samples(self, parent: Request) -> None:
        """Samples 1 .. n-1 share the parent's computed prompt blocks, recompute the last
        prompt token, and copy the block it lands in when the parent wrote into it."""
        parent.forked = True
        members = self._groups.setdefault(parent.request_id, [parent])
        block_size = self.kv.block_size
        num_prompt_tokens = len(parent.prompt_token_ids)
        num_computed = num_prompt_tokens - 1
        num_shared = num_computed // block_size
        needs_copy = num_computed % block_size != 0
        for index in range(1, parent.n):
            child = parent.fork_sample(index)
            child.slot_view = OracleSlotFacts()
            self.requests[child.request_id] = child
            members.append(child)
            self.outputs.start(child)
            if child.deadline is not None:
                heapq.heappush(self._deadlines, (child.deadline, child.request_id))
            if not (self.slots.num_free and len(self.running) < self.max_num_seqs
                    and (self.kv.num_free_blocks > 0 or not needs_copy)):
                self.policy.add(child)
                continue
            child.status = RequestStatus.RUNNING
            child.slot = self.slots.allocate()
            child.first_scheduled_time = time.monotonic()
            shared = parent.block_ids[:num_shared]
            self.kv.pool.incref(shared)
            child_facts = facts_of(child)
            child_facts.block_ids = list(shared)
            self.kv.hashes[child.request_id] = self.kv.hashes.get(parent.request_id, [])[:num_shared]
            copy = None
            if needs_copy:
                destination = self.kv.pool.allocate(1)[0]
                copy = (parent.block_ids[num_shared], destination)
                child_facts.block_ids.append(destination)
            child_facts.num_computed_tokens = child.num_cached_tokens = num_computed
            self._pending_forks[child.slot] = (NewSequence(
                slot=child.slot, token_ids=list(child.prompt_token_ids), sampling=child.sampling,
                num_computed_tokens=num_computed,
                num_prompt_tokens=len(child.prompt_token_ids)), copy)
            self._unsent_tables.add(id(child))
            self.running.append(child)
