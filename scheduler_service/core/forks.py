"""Parallel samples (n > 1): samples 1 .. n-1 fork from sample 0 once its prompt is computed,
sharing its prompt blocks (copy-on-write for the last one).

A part of the Scheduler (core/scheduler.py), split off by lifecycle: it reads and writes
the scheduler's state as the scheduler's own methods do."""

from __future__ import annotations

import heapq
import time

from scheduler_service.core.part import SchedulerPart
from scheduler_service.core.plan import StepPlan
from scheduler_service.core.request import Request, RequestStatus


class ParallelSamples(SchedulerPart):
    """Forking the samples of a request with n > 1 (a part of Scheduler)."""

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
            self.loras.on_arrive(child.lora_name)
            members.append(child)
            self.outputs.start(child)
            if child.guide is not None:
                self._num_constrained += 1
            if child.deadline is not None:
                heapq.heappush(self._deadlines, (child.deadline, child.request_id))
            if (
                self.slots.num_free
                and len(self.running) < self.max_num_seqs
                and (self.kv.num_free_blocks > 0 or not needs_copy)
            ):
                self._start_fork(parent, child)
            else:
                self.policy.add(child)

    def _start_fork(self, parent: Request, child: Request) -> None:
        num_prompt_tokens = len(parent.prompt_token_ids)
        num_computed = num_prompt_tokens - 1
        child.status = RequestStatus.RUNNING
        slot = child.slot = self.slots.allocate()
        child.first_scheduled_time = time.monotonic()
        copy = self.core.fork(
            parent.running_slot,
            slot,
            child,
            num_prompt_tokens,
            num_prompt_tokens + child.stopping.max_new_tokens,
        )
        child.num_cached_tokens = num_computed
        self._pending_forks[slot] = (
            self._new_sequence(child, slot, list(child.prompt_token_ids)),
            copy,
        )
        self.running.append(child)
        self.loras.on_start(child.lora_name, self._next_step_id)

    def _register_forks(self, plan: StepPlan) -> None:
        """Forked samples still running join the plan: registered, their copy before the
        forward. (Done last, so that a sample preempted in this very step is never sent.)"""
        for sequence, copy in self._pending_forks.values():
            plan.new_sequences.append(sequence)
            if copy is not None:
                plan.copy_src.append(copy[0])
                plan.copy_dst.append(copy[1])
        for request in self.running:
            if request.slot in self._pending_forks:
                self._pending_forks.clear()
