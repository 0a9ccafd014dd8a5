"""The plain step's fast path: a plan that only schedules slots and hands them new blocks (most
decode steps, and prefill chunks of sequences already registered) is read, checked and applied,
and its result written, by C loops (cython_ext/decode_step.pyx) instead of array code per field.

    server    parse_request(wire bytes)   -> PlanArrays(plain=True), or None: batch.from_pb
    runner    check_and_append(plan)      -> the plan's new blocks appended; True when every
                                             scheduled slot samples by a plain argmax
    server    encode_result(output)       -> ExecuteResponse bytes, or None: batch.result_to_pb

Errors keep one wording: whenever the C code refuses a plan, the Python path runs on the same
plan and raises its PlanError (the field and the bound); the state is unchanged until then.
tests/model_service/test_ms_decode_fast.py runs both paths over the same random plans.
"""

from __future__ import annotations

import numpy as np

from cython_ext import decode_step
from model_service.step.plan import ComputedStep, PlanArrays, PlanLimits
from model_service.step.slot_checks import check_plan
from model_service.step.slot_table import SlotTable

# The plain plan's absent fields share these (a size-0 array cannot be written through).
_NONE = np.zeros(0, dtype=np.int64)
_NO_MASKS: dict[int, np.ndarray] = {}


def parse_request(request_wire: bytes, limits: PlanLimits) -> PlanArrays | None:
    """A serialized ExecuteRequest's plan as PlanArrays when it is plain and passes
    batch.from_pb's checks, else None (from_pb then decodes it, and names the field of any
    error)."""
    return _plan_arrays(
        decode_step.parse_decode_request(request_wire, limits.max_num_slots, limits.num_kv_blocks),
        limits,
    )


def parse_plan(plan_wire: bytes, limits: PlanLimits) -> PlanArrays | None:
    """parse_request of a serialized BatchPlan."""
    return _plan_arrays(
        decode_step.parse_decode_plan(plan_wire, limits.max_num_slots, limits.num_kv_blocks),
        limits,
    )


def _plan_arrays(parsed, limits: PlanLimits) -> PlanArrays | None:
    if parsed is None:
        return None
    step_id, slots, num_scheduled, num_new_blocks, new_block_ids = parsed
    words = -(-limits.vocab_size // 32)
    masks = _NO_MASKS.get(words)
    if masks is None:
        masks = _NO_MASKS[words] = np.zeros((0, words), dtype=np.uint32)
    return PlanArrays(
        step_id,
        [],
        slots,
        num_scheduled,
        num_new_blocks,
        new_block_ids,
        *(_NONE,) * 6,  # finished, preempted, aborted, copy_src, copy_dst, masked_slots
        masks,
        *(_NONE,) * 4,  # swaps
        plain=True,
    )


def check_and_append(
    plan: PlanArrays, table: SlotTable, limits: PlanLimits, block_size: int
) -> bool:
    """slot_checks.check_plan and the block part of the runner's diff for a plain plan, with no
    speculation and no adapters; True when every scheduled slot samples greedily with no logits
    processing and no logprobs. Raises check_plan's PlanError with the table unchanged."""
    answer = decode_step.check_decode(
        table,
        plan.slots,
        plan.num_scheduled_tokens,
        plan.num_new_blocks,
        plan.new_block_ids,
        limits.max_model_len,
        block_size,
    )
    if answer == decode_step.CHECK_FAILED:
        check_plan(plan, table, limits, block_size, 0)  # raises, naming the field
        raise RuntimeError(f"step {plan.step_id}: the C checks refused a plan check_plan accepts")
    return bool(answer == decode_step.CHECKED_GREEDY)


def encode_result(output: ComputedStep, total_ns: int) -> bytes | None:
    """The ExecuteResponse of a step without logprobs as wire bytes, else None."""
    if output.logprobs.size or output.prompt_logprobs.size:
        return None
    return decode_step.encode_result(
        output.step_id,
        np.ascontiguousarray(output.num_sampled_tokens, dtype=np.int64),
        np.ascontiguousarray(output.sampled_token_ids, dtype=np.int64),
        output.forward_ns,
        output.sample_ns,
        total_ns,
        output.num_draft_tokens,
        output.num_accepted_draft_tokens,
    )
