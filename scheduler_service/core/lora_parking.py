"""Parking: adapters take turns at the step's max_loras places, and a running sequence whose
adapter is out of turn sits the step out, keeping its slot and its KV blocks.

--max-loras bounds the distinct adapters in one *step* (the model service checks the plan's
scheduled slots, model_service/lora/grouping.py), not the adapters holding slots. So with
parking (`lora_park_after_steps` = Q > 0) a place is a turn, not a lifetime:

  * `LoraTurns.active` (core/loras.py) holds at most max_loras adapters: those whose sequences
    run this step. Only they admit waiting requests; an adapter takes a free place at once.
  * A running sequence of any other adapter is *parked*: `StepCore.hold` leaves it out of the
    step's plan (the running passes skip it, no entry, no tokens). It keeps its slot, its
    blocks, its counts; nothing is recomputed and nothing is swapped.
  * Adapters wanting a turn (parked sequences, or waiting requests skipped for want of a place)
    queue by when they started waiting. At each step's start they take the free places, then
    the places of active adapters that have held theirs Q steps (oldest turn first); an adapter
    whose turn ends while it still has requests queues behind the others.

So with K adapters in use over P places each gets Q steps in every (K / P) * Q, and a new
request's first token comes within about (K / P - 1) * Q steps, with no preemption.

Why leaving a decode out is safe, also under overlap (core/overlap.py): the model service keeps
every sampled token in its own slot table (model_service/step/slot_table.py) and feeds a decode
from there, whenever that slot is next scheduled; plans run in order. A sequence left out of the
plan built while its token is in flight holds a placeholder, reconciled when that result comes,
as for any sequence the token budget leaves out. Speculation's draft model catches up on what
it has not computed; sampling draws by (seed, position), so a parked and resumed sequence draws
the tokens it would have drawn running alone. A grammar's state moves with its tokens, not
with the steps.

What stays as it was: KV (a parked sequence's blocks count in the decode reserve; when blocks
run out the policy's victim, parked or not, is preempted as usual), slots (a parked sequence
holds one: max_num_slots bounds the sequences in flight, --max-num-seqs the sequences of one
step, which parked ones are not), aborts (a parked request leaves and frees its blocks like any
running one), the starvation bound (the starved request's adapter takes the oldest turn as
soon as it is loaded; an adapter is drained only to make room for a load).
"""

from __future__ import annotations

from scheduler_service.core.loras import LoraState
from scheduler_service.core.part import SchedulerPart


class LoraParking(SchedulerPart):
    """Turns and parking before a step's running sequences are scheduled (a part of
    Scheduler)."""

    loras: LoraState
    _next_step_id: int

    @property
    def lora_parking(self) -> bool:
        """Parking is the rule in force: on, and preemptive rotation (which replaces it) off."""
        config = self.config
        return bool(
            self.loras.enabled
            and config.lora_park_after_steps
            and not config.lora_preempt_after_steps
        )

    def _lora_park(self, step_id: int) -> None:
        """Gives the step's turns and parks every running sequence whose adapter has none
        (after StepCore.begin_step: a hold is for this step)."""
        loras, turns = self.loras, self.loras.turns
        turns.on = self.lora_parking
        if not turns.on:
            return
        turns.next_turns(loras, step_id, self.config.lora_park_after_steps)
        active = turns.active
        turns.num_parked = 0
        if all(name in active for name in loras.running):
            return
        hold = self.core.hold
        for request in self.running:
            name = request.lora_name
            if name and name not in active:
                hold(request.running_slot)
                request.lora_parked_step = step_id
                turns.note_waiting(name, step_id)
                turns.num_parked += 1
        turns.num_parked_total += turns.num_parked
