"""The engine-contract suite: does a server speak `planserve.v1.EngineService` as the scheduler
expects (protos/planserve/v1/engine.proto)? Run it with `planserve conformance --engine HOST:PORT`
against an engine no scheduler is using: it opens its own Execute streams, one at a time.

Greedy outputs are compared with each other, never with fixed tokens, so any model passes: the
sequence computed one way (one-shot prefill, then decodes) is the reference for the same prompt
computed another way (in chunks, batched with others, from cached blocks, after a finish, an
abort or a preemption in the same slot). An engine that keeps stale state, applies a plan's
steps in the wrong order or returns results out of slot order gets other tokens.
"""

from __future__ import annotations

import json

from grpc_health.v1 import health_pb2

from planserve.contract import CONTRACT_VERSION
from tools.conformance.engine_bad_plans import BAD_PLAN_CHECKS
from tools.conformance.engine_context import SERVICE_NAME, EngineContext, same_as_reference
from tools.conformance.report import Check, CheckFailed, Skipped, check, expect

__all__ = ["CHECKS", "CONTRACT_VERSION", "SERVICE_NAME", "EngineContext"]

CHECKS: list[Check] = []


@check(CHECKS, "describe", "Describe: contract version 1, a consistent capacity, a tokenizer")
async def check_describe(ctx: EngineContext) -> str:
    f = await ctx.facts()
    expect(
        f.contract_version == CONTRACT_VERSION,
        f"contract_version is {f.contract_version}, the scheduler speaks {CONTRACT_VERSION}",
    )
    for name in ("vocab_size", "block_size", "max_num_slots", "max_model_len"):
        expect(getattr(f, name) >= 1, f"{name} is {getattr(f, name)}, must be >= 1")
    expect(
        f.num_kv_blocks >= 2, f"num_kv_blocks is {f.num_kv_blocks}; block 0 is reserved, so >= 2"
    )
    bad_eos = [t for t in f.eos_token_ids if t >= f.vocab_size]
    expect(not bad_eos, f"eos_token_ids {bad_eos} are outside the vocabulary [0, {f.vocab_size})")
    if f.HasField("bos_token_id"):
        expect(
            f.bos_token_id < f.vocab_size,
            f"bos_token_id {f.bos_token_id} is outside the vocabulary",
        )
    expect(f.tokenizer_json != "", "tokenizer_json is empty; the scheduler tokenizes text with it")
    try:
        json.loads(f.tokenizer_json)
    except ValueError as error:
        expect(False, f"tokenizer_json is not JSON: {error}")
    expect(
        f.max_model_len >= 4 * f.block_size + 8,
        f"max_model_len {f.max_model_len} is too short for these checks (need "
        f"{4 * f.block_size + 8})",
    )
    return (
        f"{f.model_name or '(no name)'}: vocab {f.vocab_size}, {f.num_kv_blocks} KV blocks of "
        f"{f.block_size} tokens, {f.max_num_slots} slots, max length {f.max_model_len}, "
        f"{f.dtype} on {f.device}"
    )


@check(CHECKS, "health", 'grpc.health.v1 reports SERVING for "" and planserve.v1.EngineService')
async def check_health(ctx: EngineContext) -> None:
    for service in ("", SERVICE_NAME):
        reply = await ctx.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        expect(
            reply.status == health_pb2.HealthCheckResponse.SERVING,
            f"health of {service!r} is "
            f"{health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
        )


@check(
    CHECKS, "prefill", "register a sequence and prefill it in one step: one token, step_id echoed"
)
async def check_prefill(ctx: EngineContext) -> str:
    async with ctx.stream() as s:
        token = await s.prefill(0, ctx.prompt(1))
    return f"{len(ctx.prompt(1))}-token prompt -> token {token}"


@check(
    CHECKS,
    "decode",
    "one-token decode steps across a block boundary; greedy is repeatable on "
    "another slot and stream",
)
async def check_decode(ctx: EngineContext) -> str:
    reference = await ctx.reference(ctx.prompt(1))
    last = (await ctx.facts()).max_num_slots - 1
    async with ctx.stream() as s:
        await s.prefill(last, ctx.prompt(1))
        await s.decode([last], ctx.decode_steps())
        same_as_reference(s.slots[last].generated, reference, f"slot {last} on a second stream")
    return f"{len(reference)} tokens"


@check(
    CHECKS,
    "chunked_prefill",
    "a prompt computed over several steps samples only at its end, and the same token",
)
async def check_chunked_prefill(ctx: EngineContext) -> str:
    facts = await ctx.facts()
    if not facts.features.chunked_prefill:
        raise Skipped("features.chunked_prefill is false")
    reference = await ctx.reference(ctx.prompt(1))
    chunk = max(1, facts.block_size - 1)  # chunks that end inside blocks
    async with ctx.stream() as s:
        await s.prefill(0, ctx.prompt(1), chunk=chunk)
        await s.decode([0], 3)
        same_as_reference(s.slots[0].generated, reference, f"prefilled in chunks of {chunk}")
    return f"chunks of {chunk} tokens"


@check(
    CHECKS,
    "batch",
    "slots batched in one step are independent and results follow the plan's slot order",
)
async def check_batch(ctx: EngineContext) -> str:
    facts = await ctx.facts()
    if facts.max_num_slots < 3:
        raise Skipped(f"max_num_slots is {facts.max_num_slots}; needs 3")
    reference = await ctx.reference(ctx.prompt(1))
    # Scheduled in an order that is not the slots' sorted order, the odd one in the middle.
    first, middle, last = facts.max_num_slots - 1, 0, facts.max_num_slots // 2
    async with ctx.stream() as s:
        plan = s.plan()
        for slot, salt in ((first, 1), (middle, 2), (last, 1)):
            s.register(plan, slot, ctx.prompt(salt))
            s.schedule(plan, slot, len(ctx.prompt(salt)))
        await s.send(plan)
        await s.decode([first, middle, last], 4)
        for slot in (first, last):
            same_as_reference(
                s.slots[slot].generated,
                reference,
                f"slot {slot}, scheduled in slots {list(plan.slots)}",
            )
    return f"slots {[first, middle, last]}"


@check(
    CHECKS,
    "prefix_cache",
    "a sequence registered with num_computed_tokens over another's "
    "cached blocks continues as if it had computed them",
)
async def check_prefix_cache(ctx: EngineContext) -> str:
    facts = await ctx.facts()
    prompt = ctx.prompt(1)
    reference = await ctx.reference(prompt)
    cached = 2 * facts.block_size
    async with ctx.stream() as s:
        await s.prefill(0, prompt)
        plan = s.plan()
        s.register(
            plan, 1, prompt, num_computed_tokens=cached, cached_blocks=tuple(s.slots[0].blocks[:2])
        )
        s.schedule(plan, 1, len(prompt) - cached)
        await s.send(plan)
        await s.decode([0, 1], 2)
        same_as_reference(s.slots[1].generated, reference, f"slot 1 with {cached} cached tokens")
    return f"{cached} of {len(prompt)} prompt tokens from slot 0's blocks"


@check(
    CHECKS,
    "block_copy",
    "copy_src -> copy_dst runs before the forward: a sequence continues "
    "on a copy of another's partial block (copy-on-write)",
)
async def check_block_copy(ctx: EngineContext) -> str:
    facts = await ctx.facts()
    if not facts.features.block_copy:
        raise Skipped("features.block_copy is false")
    # A prompt one token short of a block: nearly all of its KV is in the block that is copied.
    prompt = ctx.prompt(4, length=max(facts.block_size - 1, 3))
    reference = await ctx.reference(prompt)
    async with ctx.stream() as s:
        await s.prefill(0, prompt)
        full, partial = s.slots[0].blocks[:-1], s.slots[0].blocks[-1]
        (copy,) = s.blocks.take(1)
        # Slot 1 holds slot 0's full blocks (if any) and a copy of its last, partial one; it
        # recomputes only the last prompt token, which attends over the copied KV.
        plan = s.plan()
        plan.copy_src.append(partial)
        plan.copy_dst.append(copy)
        s.register(
            plan, 1, prompt, num_computed_tokens=len(prompt) - 1, cached_blocks=(*full, copy)
        )
        s.schedule(plan, 1, 1)
        await s.send(plan)
        await s.decode([0, 1], 2)  # each writes its own last block now
        for slot in (0, 1):
            same_as_reference(
                s.slots[slot].generated,
                reference,
                f"slot {slot} after block {partial} was copied to {copy}",
            )
    return f"block {partial} -> {copy}"


@check(
    CHECKS,
    "swap",
    "a sequence preempted by swap (device -> host) and resumed by swap-in into "
    "other device blocks continues where it was",
)
async def check_swap(ctx: EngineContext) -> str:
    facts = await ctx.facts()
    if not facts.features.swap:
        raise Skipped("features.swap is false")
    prompt = ctx.prompt(1)
    reference = await ctx.reference(prompt)
    async with ctx.stream() as s:
        await s.prefill(0, prompt)
        await s.decode([0], 2)
        seq = s.slots[0]
        known, computed, device = list(seq.tokens), seq.num_computed_tokens, list(seq.blocks)
        expect(
            len(device) <= facts.num_swap_blocks,
            f"num_swap_blocks {facts.num_swap_blocks} cannot hold the {len(device)} blocks "
            "swapped out",
        )
        host = list(range(len(device)))
        plan = s.plan()
        s.drop(plan, "preempted", 0)
        plan.swap_out_src.extend(device)
        plan.swap_out_dst.extend(host)
        await s.send(plan)
        # Another sequence takes the freed device blocks (and overwrites their KV) meanwhile.
        await s.prefill(1, ctx.prompt(5, length=len(device) * facts.block_size - 1))
        fresh = s.blocks.take(len(device))
        plan = s.plan()
        plan.swap_in_src.extend(host)
        plan.swap_in_dst.extend(fresh)
        s.register(
            plan,
            0,
            known,
            num_computed_tokens=computed,
            cached_blocks=tuple(fresh),
            prompt_len=len(prompt),
        )
        s.blocks.release(fresh)  # held through the slot's block table from here on
        s.schedule(plan, 0, len(known) - computed)
        await s.send(plan)
        await s.decode([0, 1], 2)
        same_as_reference(
            s.slots[0].generated,
            reference,
            f"slot 0 swapped out to host blocks {host} and in to {fresh}",
        )
    return f"{len(device)} blocks out and back in"


async def _drop_and_reuse(ctx: EngineContext, kind: str) -> None:
    """Slots 0 and 1 run another prompt; one plan drops both (`kind`) and registers slot 0 with
    the reference prompt on the freed blocks. Dropped first, then registered: the contract's
    order of application; then slot 1, dropped and not registered again, must be refused."""
    reference = await ctx.reference(ctx.prompt(1))
    async with ctx.stream() as s:
        for slot in (0, 1):
            await s.prefill(slot, ctx.prompt(3))
        await s.decode([0, 1], 2)
        plan = s.plan()
        s.drop(plan, kind, 0)
        s.drop(plan, kind, 1)
        s.register(plan, 0, ctx.prompt(1))
        s.schedule(plan, 0, len(ctx.prompt(1)))
        try:
            await s.send(plan)
        except CheckFailed as failure:
            raise CheckFailed(
                f"a plan with {kind}_slots [0, 1] that registers slot 0 again was "
                f"refused ({kind} slots must be dropped first): {failure}"
            ) from None
        await s.decode([0], 2)
        same_as_reference(
            s.slots[0].generated, reference, f"slot 0 after {kind} and registered in the same plan"
        )
        stale = s.plan()
        stale.slots.append(1)
        stale.num_scheduled_tokens.append(1)
        stale.num_new_blocks.append(0)
        try:
            await s.expect_rejected(stale, ("slots",))
        except CheckFailed as failure:
            raise CheckFailed(f"scheduling slot 1 after it was {kind}: {failure}") from None


@check(
    CHECKS,
    "finish",
    "finished_slots are dropped before the plan's new sequences: a slot is "
    "reused at once with no stale state",
)
async def check_finish(ctx: EngineContext) -> None:
    await _drop_and_reuse(ctx, "finished")


@check(
    CHECKS, "abort", "aborted_slots are dropped before the plan's new sequences, and stay dropped"
)
async def check_abort(ctx: EngineContext) -> None:
    await _drop_and_reuse(ctx, "aborted")


@check(
    CHECKS,
    "preempt",
    "a preempted sequence resumed by recompute (prompt + generated tokens) continues where it was",
)
async def check_preempt(ctx: EngineContext) -> None:
    prompt = ctx.prompt(1)
    reference = await ctx.reference(prompt)
    async with ctx.stream() as s:
        await s.prefill(0, prompt)
        await s.decode([0], 3)
        known = list(s.slots[0].tokens)
        plan = s.plan()
        s.drop(plan, "preempted", 0)
        await s.send(plan)
        plan = s.plan()
        s.register(plan, 0, known, prompt_len=len(prompt))
        s.schedule(plan, 0, len(known))
        await s.send(plan)
        same_as_reference(s.slots[0].generated, reference, "resumed after preemption")


@check(CHECKS, "stream_end", "ending the Execute stream drops every slot: a new stream reuses them")
async def check_stream_end(ctx: EngineContext) -> None:
    reference = await ctx.reference(ctx.prompt(1))
    async with ctx.stream() as s:
        await s.prefill(0, ctx.prompt(2))
    async with ctx.stream() as s:
        await s.prefill(0, ctx.prompt(1))
        same_as_reference(s.slots[0].generated, reference, "slot 0 on a new stream")


CHECKS.extend(BAD_PLAN_CHECKS)


@check(CHECKS, "recovers", "after the bad plans, a new stream serves the reference again")
async def check_recovers(ctx: EngineContext) -> None:
    reference = await ctx.reference(ctx.prompt(1))
    async with ctx.stream() as s:
        await s.prefill(0, ctx.prompt(1))
        await s.decode([0], 2)
        same_as_reference(s.slots[0].generated, reference, "after the bad plans")
