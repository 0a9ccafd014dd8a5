"""The engine contract's bad plans: each must end the stream with INVALID_ARGUMENT naming the
field (`planserve conformance --engine --check bad_plan`)."""

from __future__ import annotations

from typing import Callable

from planserve.v1 import common_pb2, engine_pb2
from tools.conformance.engine_context import EngineContext
from tools.conformance.engine_driver import GREEDY
from tools.conformance.report import Check

BAD_PLAN_CHECKS: list[Check] = []


# -- bad plans: each must end the stream with INVALID_ARGUMENT naming the field ------------------


def _raw_schedule(plan: engine_pb2.BatchPlan, slot: int, tokens: int, block_ids: list[int]) -> None:
    plan.slots.append(slot)
    plan.num_scheduled_tokens.append(tokens)
    plan.num_new_blocks.append(len(block_ids))
    plan.new_block_ids.extend(block_ids)


def _new(slot: int, tokens: list[int]) -> engine_pb2.NewSequence:
    return engine_pb2.NewSequence(
        slot=slot,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        sampling=common_pb2.SamplingParams(**GREEDY),
    )


def _bad_plan(name: str, what: str, fields: tuple[str, ...]):
    """Registers a bad-plan check: `build(ctx, stream)` returns the plan (after any setup steps)."""

    def register(build: Callable) -> Callable:
        async def run(ctx: EngineContext) -> str:
            async with ctx.stream() as s:
                plan = await build(ctx, s)
                return await s.expect_rejected(plan, fields)

        BAD_PLAN_CHECKS.append(Check(f"bad_plan.{name}", what + " -> INVALID_ARGUMENT", run))
        return build

    return register


def _blocks_for(ctx: EngineContext, tokens: int) -> list[int]:
    return list(range(1, 1 + -(-tokens // ctx._facts.block_size)))


@_bad_plan("slot_out_of_range", "a new sequence on slot max_num_slots", ("slot",))
async def _(ctx, s):
    plan, p = s.plan(), ctx.prompt(1)
    plan.new_sequences.append(_new(ctx._facts.max_num_slots, p))
    return plan


@_bad_plan("empty_prompt", "a new sequence without tokens", ("token_ids",))
async def _(ctx, s):
    plan = s.plan()
    plan.new_sequences.append(_new(0, []))
    return plan


@_bad_plan("token_outside_vocab", "a token id equal to vocab_size", ("token_ids",))
async def _(ctx, s):
    plan = s.plan()
    plan.new_sequences.append(_new(0, [1, ctx._facts.vocab_size]))
    return plan


@_bad_plan("reserved_block", "block 0 (reserved) in new_block_ids", ("new_block_ids",))
async def _(ctx, s):
    plan, p = s.plan(), ctx.prompt(1)
    plan.new_sequences.append(_new(0, p))
    _raw_schedule(plan, 0, len(p), [0] + _blocks_for(ctx, len(p))[1:])
    return plan


@_bad_plan("block_out_of_range", "a block id equal to num_kv_blocks", ("new_block_ids",))
async def _(ctx, s):
    plan, p = s.plan(), ctx.prompt(1)
    plan.new_sequences.append(_new(0, p))
    _raw_schedule(plan, 0, len(p), _blocks_for(ctx, len(p))[:-1] + [ctx._facts.num_kv_blocks])
    return plan


@_bad_plan("unequal_arrays", "num_scheduled_tokens shorter than slots", ("num_scheduled_tokens",))
async def _(ctx, s):
    plan, p = s.plan(), ctx.prompt(1)
    plan.new_sequences.append(_new(0, p))
    plan.slots.append(0)
    plan.num_new_blocks.append(0)
    return plan


@_bad_plan("block_ids_count", "fewer new_block_ids than sum(num_new_blocks)", ("new_block_ids",))
async def _(ctx, s):
    plan, p = s.plan(), ctx.prompt(1)
    plan.new_sequences.append(_new(0, p))
    _raw_schedule(plan, 0, len(p), _blocks_for(ctx, len(p)))
    plan.num_new_blocks[0] += 1
    return plan


@_bad_plan("unregistered_slot", "scheduling a slot never registered", ("slots",))
async def _(ctx, s):
    plan = s.plan()
    _raw_schedule(plan, 0, 1, [1])
    return plan


@_bad_plan("slot_twice", "one slot scheduled twice in a plan", ("slots",))
async def _(ctx, s):
    plan, p = s.plan(), ctx.prompt(1)
    plan.new_sequences.append(_new(0, p))
    _raw_schedule(plan, 0, 1, [1])
    _raw_schedule(plan, 0, 1, [])
    return plan


@_bad_plan("slot_occupied", "registering a slot that holds a sequence", ("slot",))
async def _(ctx, s):
    await s.prefill(0, ctx.prompt(1))
    plan = s.plan()
    plan.new_sequences.append(_new(0, ctx.prompt(2)))
    return plan


@_bad_plan(
    "past_known_tokens", "more tokens scheduled than the sequence knows", ("num_scheduled_tokens",)
)
async def _(ctx, s):
    plan, p = s.plan(), ctx.prompt(1)
    plan.new_sequences.append(_new(0, p))
    _raw_schedule(plan, 0, len(p) + 1, _blocks_for(ctx, len(p) + 1))
    return plan


@_bad_plan(
    "too_few_blocks",
    "fewer blocks than the scheduled tokens need",
    ("num_new_blocks", "new_block_ids"),
)
async def _(ctx, s):
    plan, p = s.plan(), ctx.prompt(1)
    plan.new_sequences.append(_new(0, p))
    _raw_schedule(plan, 0, len(p), [1])
    return plan


@_bad_plan("drop_unregistered", "finishing a slot that holds nothing", ("finished_slots",))
async def _(ctx, s):
    plan = s.plan()
    plan.finished_slots.append(1)
    return plan


@_bad_plan(
    "unpaired_copies", "copy_src and copy_dst of different lengths", ("copy_src", "copy_dst")
)
async def _(ctx, s):
    plan = s.plan()
    plan.copy_src.extend([1, 2])
    plan.copy_dst.append(3)
    return plan


@_bad_plan(
    "step_id_not_increasing",
    "a step_id equal to the previous one (step ids strictly increase)",
    ("step_id",),
)
async def _(ctx, s):
    await s.prefill(0, ctx.prompt(1))
    plan = s.plan()
    plan.step_id = s.last_step_id  # the prefill's own step_id
    s.schedule(plan, 0, 1)
    return plan
