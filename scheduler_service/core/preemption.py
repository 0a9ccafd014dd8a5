"""Step 3 of the step rule: when blocks run out, the policy's victim is preempted, by swap when
the swap space holds its KV (core/swap.py), else by recompute.

A part of the Scheduler (core/scheduler.py), split off by lifecycle: it reads and writes
the scheduler's state as the scheduler's own methods do."""

from __future__ import annotations

from scheduler_service.core.kv_blocks import cdiv
from scheduler_service.core.part import SchedulerPart
from scheduler_service.core.plan import StepPlan
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.engine.client import EngineFacts


class Preemption(SchedulerPart):
    """Making room by preemption (a part of Scheduler)."""

    def _on_blocks_exhausted(self, slot: int) -> bool:
        """StepCore's call when the sequence in `slot` needs more blocks than are free: preempts
        the policy's victim among the running sequences not yet scheduled in this step, parked
        ones included (core/lora_parking.py). True when the victim is that sequence itself
        (nothing else fits either)."""
        core, plan = self.core, self._plan
        if plan is None:
            raise RuntimeError(f"slot {slot} ran out of blocks outside schedule()")
        request = self.running_in(slot)
        victim = self.policy.select_victim(
            [
                r
                for r in self.running
                if r.lora_parked_step == plan.step_id or not core.is_scheduled(r.running_slot)
            ]
        )
        self._preempt(victim, plan)
        return victim is request

    def running_in(self, slot: int) -> Request:
        for request in self.running:
            if request.slot == slot:
                return request
        raise KeyError(slot)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Preemption: free the device blocks, requeue ahead of fresh requests. By swap when the
        swap space has room for the sequence's computed KV (copied out before this step's
        forward; it resumes where it stopped, scheduler_service/core/swap.py), else by recompute
        (it starts over from its tokens). The model service drops the slot before this step
        runs (unless it never heard of it: a pending fork, always recomputed)."""
        slot = request.running_slot
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
        self.running.remove(request)
        self.loras.on_stop(request.lora_name, self._next_step_id)
        self._free_blocks(request)
        self.slots.free(slot)
        request.slot = None
        # Out of its slot: the count it resumes from is the request's own again.
        request.num_computed_tokens = num_kept if by_swap else 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.policy.add_preempted(request)

    def _free_blocks(self, request: Request) -> None:
        if request.slot is not None:  # running: its blocks are in the core's slot
            self.core.release(request.slot)
        else:  # waiting: it may hold swap blocks
            self.swap.discard(request)

    def _swap_in(self, plan: StepPlan, request: Request, slot: int) -> None:
        """A swapped-out request just admitted in `slot`: its first blocks are filled from swap
        space before the forward (its block table was sent whole with this plan)."""
        host = self.swap.swap_in(request)
        plan.swap_in_src.extend(host)
        plan.swap_in_dst.extend(self.core.block_ids(slot)[: len(host)])

    def _usable_swap_blocks(self, facts: EngineFacts) -> int:
        if self.config.preemption_mode == "recompute":
            return 0
        return facts.num_swap_blocks
