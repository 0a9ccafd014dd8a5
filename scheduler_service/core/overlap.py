"""Overlap: the next plan is built while the model service computes this one. A plan is committed
as if it had completed (placeholder tokens) and reconciled when its result comes; see
engine/loop.py for the loop that keeps two plans in flight.

A part of the Scheduler (core/scheduler.py), split off by lifecycle: it reads and writes
the scheduler's state as the scheduler's own methods do."""

from __future__ import annotations

import time
from typing import Optional

from scheduler_service.core.part import SchedulerPart
from scheduler_service.core.plan import StepPlan, StepResult
from scheduler_service.core.request import Request, RequestOutput, TokenLogprob


class Overlap(SchedulerPart):
    """Committing a plan ahead of its result and reconciling it (a part of Scheduler)."""

    @property
    def needs_lockstep(self) -> bool:
        """A plan can only be built once the previous one's tokens are known: a speculating
        decode's length depends on them. (A grammar's mask does too, but only its own
        sequence's: commit() keeps that one out of the plan built meanwhile.)"""
        return self.facts.num_speculative_tokens > 0

    def commit(self, plan: StepPlan) -> None:
        """Applies a plan as if it had completed, before its result: computed counts advance and
        every entry that samples gets a placeholder token (its id is on the model side, which
        feeds it to the next step by itself), so the next plan can be built right away.
        Prefix-cache registration waits for reconcile(), when the ids are real.

        A constrained sequence (structured output, tools) gets no placeholder: its next mask
        needs the token, so it has nothing to compute until the token comes back and the
        plan built meanwhile leaves it out (it runs every other plan while the others run in
        every one); reconcile() appends its token as lockstep's update() does."""
        if plan.packed is None:
            raise ValueError("commit needs a plan built by schedule()")
        plan.prompt_starts = {
            index: request.num_computed_tokens
            for index, request in enumerate(plan.requests)
            if request.prompt_logprobs is not None
        }
        expected = self.core.sampling_entries(plan.packed)
        self.core.advance(plan.packed, expected, cache_blocks=False)
        held = None  # constrained sequences: their tokens are appended when they come
        if self._num_constrained:
            held = {i for i, request in enumerate(plan.requests) if request.guide is not None}
        plan.placeholders = self.core.add_placeholders(plan.packed, expected, held)

    def reconcile(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, RequestOutput]]:
        """The result of a committed plan: real token ids replace the placeholders, stops are
        checked (a request that stopped here was already scheduled in the next plan: that
        token is discarded when its result comes, the slot having been released), blocks
        enter the prefix cache. Entries whose sequence left its slot since (preempted, aborted)
        are skipped; a preempted one recomputes and samples that token again."""
        packed = plan.packed
        if packed is None:
            raise ValueError("reconcile needs a plan built by schedule()")
        self.loras.completed_step = plan.step_id  # its released slots are gone on the model side
        if result.prompt_logprobs:
            self._take_prompt_logprobs(plan, result, plan.prompt_starts)
        live = set(self.core.live_entries(packed))
        now = time.monotonic()
        logprobs = LogprobReader(result.logprobs, result.logprob_token_ids)
        sampled = result.sampled_token_ids

        def take_entry(index: int, offset: int, count: int) -> Optional[RequestOutput]:
            request = plan.requests[index]
            token_ids = sampled[offset : offset + count]
            entries = None
            if request.logprobs is not None:
                entries = logprobs.take(token_ids, request.logprobs)
            if index not in live or index not in plan.placeholders:
                return None
            placeholder = plan.placeholders[index]
            if placeholder is None:  # a constrained sequence: every token it holds is real
                slot = plan.slots[index]
                self.core.cache_finished_blocks(slot, self.core.num_tokens(slot))
            return self._take_tokens(request, token_ids, entries, now, placeholder=placeholder)

        # The common entry (one token, nothing to stop or fork) is taken in C, in entry order;
        # take_entry takes every other one.
        outputs = self.outputs.take_step(
            plan.requests,
            sampled,
            result.num_sampled_tokens,
            live,
            plan.placeholders,
            self.core,
            now,
            take_entry,
        )
        self.core.cache_blocks(packed)
        return outputs

    def _take_prompt_logprobs(
        self, plan: StepPlan, result: StepResult, starts: Optional[dict[int, int]] = None
    ) -> None:
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
            targets = request.prompt_token_ids[start + 1 : end + 1]
            entries = reader.take(targets, request.prompt_logprobs)
            # After a recompute, positions already held come again: keep the first copy.
            have = len(request.prompt_logprobs_out)
            request.prompt_logprobs_out.extend(entries[max(0, have - start) :])


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
            top = tuple(zip(ids[i : i + k], values[v + 1 : v + 1 + k]))
            entries.append(TokenLogprob(token_id, values[v], top))
            self._value_at, self._id_at = v + 1 + k, i + k
        return entries
