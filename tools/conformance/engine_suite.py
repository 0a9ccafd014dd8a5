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

import contextlib
import json
from typing import AsyncIterator, Callable, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from planserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tools.conformance.engine_driver import GREEDY, ExecuteStream
from tools.conformance.report import Check, CheckFailed, Skipped, check, expect

SERVICE_NAME = "planserve.v1.EngineService"
CONTRACT_VERSION = 1
CHECKS: list[Check] = []


class EngineContext:
    """What the checks share: the channel, the Describe reply and the reference sequences."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._facts: Optional[engine_pb2.DescribeResponse] = None
        self._references: dict[tuple[int, ...], list[int]] = {}

    async def facts(self) -> engine_pb2.DescribeResponse:
        if self._facts is None:
            self._facts = await self.stub.Describe(engine_pb2.DescribeRequest(), timeout=30)
        return self._facts

    @contextlib.asynccontextmanager
    async def stream(self) -> AsyncIterator[ExecuteStream]:
        stream = ExecuteStream(self.stub, await self.facts())
        try:
            yield stream
        finally:
            await stream.close()

    def prompt(self, salt: int, length: Optional[int] = None) -> list[int]:
        """A deterministic prompt of `length` tokens (default: two blocks and three tokens), ids
        spread over the vocabulary."""
        facts = self._facts
        length = length or min(2 * facts.block_size + 3, facts.max_model_len // 2)
        return [(salt * 7919 + 31 * i) % (facts.vocab_size - 1) + 1 for i in range(length)]

    async def reference(self, prompt: list[int]) -> list[int]:
        """The greedy continuation of prompt (2 blocks' worth of tokens, crossing a block
        boundary): one-shot prefill on slot 0 of a fresh stream, then single-slot decodes."""
        key = tuple(prompt)
        if key not in self._references:
            async with self.stream() as s:
                await s.prefill(0, prompt)
                await s.decode([0], self.decode_steps())
                self._references[key] = s.slots[0].generated
        return self._references[key]

    def decode_steps(self) -> int:
        return min(2 * self._facts.block_size, self._facts.max_model_len // 4)

    async def close(self) -> None:
        await self.channel.close()


def _same(got: list[int], want: list[int], what: str) -> None:
    expect(got == want[:len(got)] and len(got) <= len(want),
           f"{what}: greedy tokens {got} differ from the reference {want[:len(got)]}")


@check(CHECKS, "describe", "Describe: contract version 1, a consistent capacity, a tokenizer")
async def check_describe(ctx: EngineContext) -> str:
    f = await ctx.facts()
    expect(f.contract_version == CONTRACT_VERSION,
           f"contract_version is {f.contract_version}, the scheduler speaks {CONTRACT_VERSION}")
    for name in ("vocab_size", "block_size", "max_num_slots", "max_model_len"):
        expect(getattr(f, name) >= 1, f"{name} is {getattr(f, name)}, must be >= 1")
    expect(f.num_kv_blocks >= 2, f"num_kv_blocks is {f.num_kv_blocks}; block 0 is reserved, so >= 2")
    bad_eos = [t for t in f.eos_token_ids if t >= f.vocab_size]
    expect(not bad_eos, f"eos_token_ids {bad_eos} are outside the vocabulary [0, {f.vocab_size})")
    if f.HasField("bos_token_id"):
        expect(f.bos_token_id < f.vocab_size, f"bos_token_id {f.bos_token_id} is outside the vocabulary")
    expect(f.tokenizer_json != "", "tokenizer_json is empty; the scheduler tokenizes text with it")
    try:
        json.loads(f.tokenizer_json)
    except ValueError as error:
        expect(False, f"tokenizer_json is not JSON: {error}")
    expect(f.max_model_len >= 4 * f.block_size + 8,
           f"max_model_len {f.max_model_len} is too short for these checks (need {4 * f.block_size + 8})")
    return (f"{f.model_name or '(no name)'}: vocab {f.vocab_size}, {f.num_kv_blocks} KV blocks of "
            f"{f.block_size} tokens, {f.max_num_slots} slots, max length {f.max_model_len}, "
            f"{f.dtype} on {f.device}")


@check(CHECKS, "health", "grpc.health.v1 reports SERVING for \"\" and planserve.v1.EngineService")
async def check_health(ctx: EngineContext) -> None:
    for service in ("", SERVICE_NAME):
        reply = await ctx.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        expect(reply.status == health_pb2.HealthCheckResponse.SERVING,
               f"health of {service!r} is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")


@check(CHECKS, "prefill", "register a sequence and prefill it in one step: one token, step_id echoed")
async def check_prefill(ctx: EngineContext) -> str:
    async with ctx.stream() as s:
        token = await s.prefill(0, ctx.prompt(1))
    return f"{len(ctx.prompt(1))}-token prompt -> token {token}"


@check(CHECKS, "decode", "one-token decode steps across a block boundary; greedy is repeatable on "
                         "another slot and stream")
async def check_decode(ctx: EngineContext) -> str:
    reference = await ctx.reference(ctx.prompt(1))
    last = (await ctx.facts()).max_num_slots - 1
    async with ctx.stream() as s:
        await s.prefill(last, ctx.prompt(1))
        await s.decode([last], ctx.decode_steps())
        _same(s.slots[last].generated, reference, f"slot {last} on a second stream")
    return f"{len(reference)} tokens"


@check(CHECKS, "chunked_prefill", "a prompt computed over several steps samples only at its end, "
                                  "and the same token")
async def check_chunked_prefill(ctx: EngineContext) -> str:
    facts = await ctx.facts()
    if not facts.features.chunked_prefill:
        raise Skipped("features.chunked_prefill is false")
    reference = await ctx.reference(ctx.prompt(1))
    chunk = max(1, facts.block_size - 1)  # chunks that end inside blocks
    async with ctx.stream() as s:
        await s.prefill(0, ctx.prompt(1), chunk=chunk)
        await s.decode([0], 3)
        _same(s.slots[0].generated, reference, f"prefilled in chunks of {chunk}")
    return f"chunks of {chunk} tokens"


@check(CHECKS, "batch", "slots batched in one step are independent and results follow the "
                        "plan's slot order")
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
            _same(s.slots[slot].generated, reference, f"slot {slot}, scheduled in slots {list(plan.slots)}")
    return f"slots {[first, middle, last]}"


@check(CHECKS, "prefix_cache", "a sequence registered with num_computed_tokens over another's "
                               "cached blocks continues as if it had computed them")
async def check_prefix_cache(ctx: EngineContext) -> str:
    facts = await ctx.facts()
    prompt = ctx.prompt(1)
    reference = await ctx.reference(prompt)
    cached = 2 * facts.block_size
    async with ctx.stream() as s:
        await s.prefill(0, prompt)
        plan = s.plan()
        s.register(plan, 1, prompt, num_computed_tokens=cached, cached_blocks=tuple(s.slots[0].blocks[:2]))
        s.schedule(plan, 1, len(prompt) - cached)
        await s.send(plan)
        await s.decode([0, 1], 2)
        _same(s.slots[1].generated, reference, f"slot 1 with {cached} cached tokens")
    return f"{cached} of {len(prompt)} prompt tokens from slot 0's blocks"


@check(CHECKS, "block_copy", "copy_src -> copy_dst runs before the forward: a sequence continues "
                             "on a copy of another's partial block (copy-on-write)")
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
        s.register(plan, 1, prompt, num_computed_tokens=len(prompt) - 1, cached_blocks=(*full, copy))
        s.schedule(plan, 1, 1)
        await s.send(plan)
        await s.decode([0, 1], 2)  # each writes its own last block now
        for slot in (0, 1):
            _same(s.slots[slot].generated, reference, f"slot {slot} after block {partial} was copied to {copy}")
    return f"block {partial} -> {copy}"


@check(CHECKS, "swap", "a sequence preempted by swap (device -> host) and resumed by swap-in into "
                       "other device blocks continues where it was")
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
        expect(len(device) <= facts.num_swap_blocks,
               f"num_swap_blocks {facts.num_swap_blocks} cannot hold the {len(device)} blocks swapped out")
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
        s.register(plan, 0, known, num_computed_tokens=computed, cached_blocks=tuple(fresh),
                   prompt_len=len(prompt))
        s.blocks.release(fresh)  # held through the slot's block table from here on
        s.schedule(plan, 0, len(known) - computed)
        await s.send(plan)
        await s.decode([0, 1], 2)
        _same(s.slots[0].generated, reference, f"slot 0 swapped out to host blocks {host} and in to {fresh}")
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
            raise CheckFailed(f"a plan with {kind}_slots [0, 1] that registers slot 0 again was "
                              f"refused ({kind} slots must be dropped first): {failure}") from None
        await s.decode([0], 2)
        _same(s.slots[0].generated, reference, f"slot 0 after {kind} and registered in the same plan")
        stale = s.plan()
        stale.slots.append(1)
        stale.num_scheduled_tokens.append(1)
        stale.num_new_blocks.append(0)
        try:
            await s.expect_rejected(stale, ("slots",))
        except CheckFailed as failure:
            raise CheckFailed(f"scheduling slot 1 after it was {kind}: {failure}") from None


@check(CHECKS, "finish", "finished_slots are dropped before the plan's new sequences: a slot is "
                         "reused at once with no stale state")
async def check_finish(ctx: EngineContext) -> None:
    await _drop_and_reuse(ctx, "finished")


@check(CHECKS, "abort", "aborted_slots are dropped before the plan's new sequences, and stay dropped")
async def check_abort(ctx: EngineContext) -> None:
    await _drop_and_reuse(ctx, "aborted")


@check(CHECKS, "preempt", "a preempted sequence resumed by recompute (prompt + generated tokens) "
                          "continues where it was")
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
        _same(s.slots[0].generated, reference, "resumed after preemption")


@check(CHECKS, "stream_end", "ending the Execute stream drops every slot: a new stream reuses them")
async def check_stream_end(ctx: EngineContext) -> None:
    reference = await ctx.reference(ctx.prompt(1))
    async with ctx.stream() as s:
        await s.prefill(0, ctx.prompt(2))
    async with ctx.stream() as s:
        await s.prefill(0, ctx.prompt(1))
        _same(s.slots[0].generated, reference, "slot 0 on a new stream")


# -- bad plans: each must end the stream with INVALID_ARGUMENT naming the field ------------------

def _raw_schedule(plan: engine_pb2.BatchPlan, slot: int, tokens: int, block_ids: list[int]) -> None:
    plan.slots.append(slot)
    plan.num_scheduled_tokens.append(tokens)
    plan.num_new_blocks.append(len(block_ids))
    plan.new_block_ids.extend(block_ids)


def _new(slot: int, tokens: list[int]) -> engine_pb2.NewSequence:
    return engine_pb2.NewSequence(slot=slot, token_ids=tokens, num_prompt_tokens=len(tokens),
                                  sampling=common_pb2.SamplingParams(**GREEDY))


def _bad_plan(name: str, what: str, fields: tuple[str, ...]):
    """Registers a bad-plan check: `build(ctx, stream)` returns the plan (after any setup steps)."""
    def register(build: Callable) -> Callable:
        async def run(ctx: EngineContext) -> str:
            async with ctx.stream() as s:
                plan = await build(ctx, s)
                return await s.expect_rejected(plan, fields)
        CHECKS.append(Check(f"bad_plan.{name}", what + " -> INVALID_ARGUMENT", run))
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


@_bad_plan("past_known_tokens", "more tokens scheduled than the sequence knows", ("num_scheduled_tokens",))
async def _(ctx, s):
    plan, p = s.plan(), ctx.prompt(1)
    plan.new_sequences.append(_new(0, p))
    _raw_schedule(plan, 0, len(p) + 1, _blocks_for(ctx, len(p) + 1))
    return plan


@_bad_plan("too_few_blocks", "fewer blocks than the scheduled tokens need", ("num_new_blocks", "new_block_ids"))
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


@_bad_plan("unpaired_copies", "copy_src and copy_dst of different lengths", ("copy_src", "copy_dst"))
async def _(ctx, s):
    plan = s.plan()
    plan.copy_src.extend([1, 2])
    plan.copy_dst.append(3)
    return plan


@_bad_plan("step_id_not_increasing", "a step_id equal to the previous one (step ids strictly increase)",
           ("step_id",))
async def _(ctx, s):
    await s.prefill(0, ctx.prompt(1))
    plan = s.plan()
    plan.step_id = s.last_step_id  # the prefill's own step_id
    s.schedule(plan, 0, 1)
    return plan


@check(CHECKS, "recovers", "after the bad plans, a new stream serves the reference again")
async def check_recovers(ctx: EngineContext) -> None:
    reference = await ctx.reference(ctx.prompt(1))
    async with ctx.stream() as s:
        await s.prefill(0, ctx.prompt(1))
        await s.decode([0], 2)
        _same(s.slots[0].generated, reference, "after the bad plans")
