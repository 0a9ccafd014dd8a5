"""A plan checked against the slot state before any of it is applied (batch.py checks what needs
no state), so that a bad plan leaves every slot as it was. Each check raises PlanError naming the
BatchPlan field.

The plan's lifecycle lists and registrations are first played on copies of the slot counts (in
the order the runner applies them: drops, then registrations); the scheduled slots are then
checked against those counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from model_service.step.plan import PlanArrays, PlanError, PlanLimits
from model_service.step.slot_table import SlotTable


@dataclasses.dataclass
class _SlotCounts:
    """Copies of the slot table's counts, as they will be once the plan's diff is applied."""

    active: np.ndarray
    num_tokens: np.ndarray
    num_computed: np.ndarray
    num_blocks: np.ndarray
    speculate: np.ndarray


def check_plan(
    plan: PlanArrays,
    table: SlotTable,
    limits: PlanLimits,
    block_size: int,
    num_speculative_tokens: int,
) -> None:
    """Raises PlanError if the plan does not fit the slot state; changes nothing."""
    counts = _after_diff(plan, table)
    slots = plan.slots
    if slots.size == 0:
        return
    if not counts.active[slots].all():
        raise PlanError("slots", f"slot {slots[~counts.active[slots]][0]} is not registered")
    end = counts.num_computed[slots] + plan.num_scheduled_tokens
    _check_tokens(plan, counts, end, num_speculative_tokens, limits)
    _check_blocks(plan, counts, end, block_size, table.max_blocks_per_seq)


def _after_diff(plan: PlanArrays, table: SlotTable) -> _SlotCounts:
    """The counts after the plan's drops and registrations; a drop of a free slot or a
    registration into an occupied one is refused."""
    lifecycle = (plan.finished_slots, plan.preempted_slots, plan.aborted_slots)
    if not plan.new_sequences and not any(slots.size for slots in lifecycle):
        # Most decode steps change no slot: the table's own counts, only read from here.
        return _SlotCounts(
            table.active, table.num_tokens, table.num_computed, table.num_blocks, table.speculate
        )
    counts = _SlotCounts(
        table.active.copy(),
        table.num_tokens.copy(),
        table.num_computed.copy(),
        table.num_blocks.copy(),
        table.speculate.copy(),
    )
    for name in ("finished_slots", "preempted_slots", "aborted_slots"):
        for slot in getattr(plan, name):
            if not counts.active[slot]:
                raise PlanError(name, f"slot {slot} is not registered")
            counts.active[slot] = False
    for i, seq in enumerate(plan.new_sequences):
        if counts.active[seq.slot]:
            raise PlanError(f"new_sequences[{i}].slot", f"slot {seq.slot} is occupied")
        counts.active[seq.slot] = True
        counts.num_tokens[seq.slot] = len(seq.token_ids)
        counts.num_computed[seq.slot] = seq.num_computed_tokens
        counts.num_blocks[seq.slot] = 0
        counts.speculate[seq.slot] = seq.speculate
    return counts


def _check_tokens(
    plan: PlanArrays,
    counts: _SlotCounts,
    end: np.ndarray,
    num_speculative_tokens: int,
    limits: PlanLimits,
) -> None:
    """Scheduled tokens within the known ones (plus drafts), masks on sampling slots only, and
    no sequence past max_model_len."""
    slots, num_tokens, num_computed = plan.slots, counts.num_tokens, counts.num_computed
    known = num_tokens[slots]
    lookahead: np.ndarray | int = 0
    if num_speculative_tokens:
        # A speculating decode may be granted up to k draft tokens past what is known.
        lookahead = np.where(
            (known - num_computed[slots] == 1) & counts.speculate[slots], num_speculative_tokens, 0
        )
    over = end > known + lookahead
    if over.any():
        i = int(np.argmax(over))
        raise PlanError(
            "num_scheduled_tokens",
            f"slot {slots[i]}: computed {num_computed[slots[i]]} + scheduled "
            f"{plan.num_scheduled_tokens[i]} exceeds its {num_tokens[slots[i]]} known tokens",
        )
    if plan.masked_slots.size:
        missing = ~np.isin(plan.masked_slots, slots[end >= known])
        if missing.any():
            raise PlanError(
                "masked_slots",
                f"slot {plan.masked_slots[int(np.argmax(missing))]} does not sample this step",
            )
    if end.max() > limits.max_model_len:
        raise PlanError(
            "num_scheduled_tokens",
            f"{end.max()} tokens exceed max_model_len {limits.max_model_len}",
        )


def _check_blocks(
    plan: PlanArrays,
    counts: _SlotCounts,
    end: np.ndarray,
    block_size: int,
    max_blocks_per_seq: int,
) -> None:
    """Each scheduled slot's blocks (old and new) hold its tokens, within the table's width."""
    slots = plan.slots
    blocks_after = counts.num_blocks[slots] + plan.num_new_blocks
    short = blocks_after * block_size < end
    if short.any():
        i = int(np.argmax(short))
        raise PlanError(
            "num_new_blocks",
            f"slot {slots[i]}: {blocks_after[i]} blocks cannot hold {end[i]} tokens",
        )
    if blocks_after.max() > max_blocks_per_seq:
        raise PlanError(
            "num_new_blocks",
            f"{blocks_after.max()} blocks exceed {max_blocks_per_seq} per sequence",
        )
