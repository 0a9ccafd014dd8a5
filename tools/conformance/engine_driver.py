"""The scheduler's side of the engine contract, reduced to what the conformance checks need:
one Execute stream, a mirror of the slots the engine holds (tokens, computed count, block
table) and a block allocator. Every result is checked against the contract as it arrives:
step_id echoed, one num_sampled_tokens per scheduled slot, sampled ids in the vocabulary, a
token exactly when a slot's computed tokens reach its known tokens."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import grpc

from planserve.v1 import common_pb2, engine_pb2
from tools.conformance.report import CheckFailed, describe_error, expect

GREEDY = dict(temperature=0.0, seed=0)


@dataclasses.dataclass
class Slot:
    tokens: list[int]
    prompt_len: int
    num_computed_tokens: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    # Cached blocks given at registration, still to be sent (with the slot's first schedule).
    pending_cached: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Blocks:
    """Free KV block ids, block 0 excluded (reserved). Freed ids are reused first, so a dropped
    slot's blocks go straight to the next sequence: stale state would show."""

    def __init__(self, num_kv_blocks: int) -> None:
        self.free = list(range(num_kv_blocks - 1, 0, -1))
        self.refs: dict[int, int] = {}

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise CheckFailed(
                f"the checks need {n} more KV blocks than the {len(self.free)} free; "
                "start the engine with more KV blocks"
            )
        ids = [self.free.pop() for _ in range(n)]
        for i in ids:
            self.refs[i] = 1
        return ids

    def share(self, ids: Iterable[int]) -> None:
        for i in ids:
            self.refs[i] += 1

    def release(self, ids: Iterable[int]) -> None:
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                del self.refs[i]
                self.free.append(i)


class RpcFailed(CheckFailed):
    def __init__(self, error: grpc.aio.AioRpcError, step_id: int) -> None:
        super().__init__(f"step {step_id}: the stream ended with {describe_error(error)}")
        self.code = error.code()
        self.details = error.details() or ""


class ExecuteStream:
    def __init__(self, stub, facts: engine_pb2.DescribeResponse) -> None:
        self.call = stub.Execute()
        self.facts = facts
        self.block_size = facts.block_size
        self.blocks = Blocks(facts.num_kv_blocks)
        self.slots: dict[int, Slot] = {}
        self.next_step_id = 1  # any strictly increasing ids will do; not starting at 0 on purpose
        self.last_step_id: Optional[int] = None  # of the last plan sent

    # -- building plans ----------------------------------------------------------------------

    def plan(self) -> engine_pb2.BatchPlan:
        plan = engine_pb2.BatchPlan(step_id=self.next_step_id)
        self.next_step_id += 1
        return plan

    def drop(self, plan: engine_pb2.BatchPlan, kind: str, slot: int) -> None:
        """kind: 'finished', 'preempted' or 'aborted'; the slot's blocks are free again."""
        getattr(plan, f"{kind}_slots").append(slot)
        self.blocks.release(self.slots.pop(slot).blocks)

    def register(
        self,
        plan: engine_pb2.BatchPlan,
        slot: int,
        token_ids: list[int],
        num_computed_tokens: int = 0,
        cached_blocks: tuple[int, ...] = (),
        prompt_len: Optional[int] = None,
        **sampling,
    ) -> None:
        plan.new_sequences.append(
            engine_pb2.NewSequence(
                slot=slot,
                token_ids=token_ids,
                num_computed_tokens=num_computed_tokens,
                num_prompt_tokens=prompt_len or len(token_ids),
                sampling=common_pb2.SamplingParams(**(sampling or GREEDY)),
            )
        )
        self.blocks.share(cached_blocks)
        # The cached blocks are appended by the slot's first schedule() (contract: in the
        # registering plan, the slot's new blocks hold the cached ones first).
        self.slots[slot] = Slot(
            list(token_ids),
            prompt_len or len(token_ids),
            num_computed_tokens,
            list(cached_blocks),
            len(cached_blocks),
        )

    def schedule(self, plan: engine_pb2.BatchPlan, slot: int, num_tokens: int) -> None:
        seq = self.slots[slot]
        end = seq.num_computed_tokens + num_tokens
        cached = seq.pending_cached
        needed = -(-end // self.block_size) - len(seq.blocks)
        fresh = self.blocks.take(max(needed, 0))
        seq.blocks += fresh
        new_ids = seq.blocks[len(seq.blocks) - len(fresh) - cached :]
        seq.pending_cached = 0
        plan.slots.append(slot)
        plan.num_scheduled_tokens.append(num_tokens)
        plan.num_new_blocks.append(len(new_ids))
        plan.new_block_ids.extend(new_ids)

    # -- running them ------------------------------------------------------------------------

    async def send(self, plan: engine_pb2.BatchPlan) -> dict[int, int]:
        """Runs one plan; returns {slot: sampled token} for the slots that sampled."""
        self.last_step_id = plan.step_id
        try:
            await self.call.write(engine_pb2.ExecuteRequest(plan=plan))
            response = await self.call.read()
        except grpc.aio.AioRpcError as error:
            raise RpcFailed(error, plan.step_id) from None
        expect(response is not grpc.aio.EOF, f"step {plan.step_id}: the engine closed the stream")
        result = response.result
        expect(
            result.step_id == plan.step_id,
            f"result echoes step_id {result.step_id}, the plan's is {plan.step_id}",
        )
        expect(
            len(result.num_sampled_tokens) == len(plan.slots),
            f"step {plan.step_id}: {len(result.num_sampled_tokens)} num_sampled_tokens for "
            f"{len(plan.slots)} scheduled slots (must be parallel to BatchPlan.slots)",
        )
        expect(
            len(result.sampled_token_ids) == sum(result.num_sampled_tokens),
            f"step {plan.step_id}: {len(result.sampled_token_ids)} sampled_token_ids, "
            f"sum(num_sampled_tokens) is {sum(result.num_sampled_tokens)}",
        )
        sampled, at = {}, 0
        for slot, n, k in zip(plan.slots, plan.num_scheduled_tokens, result.num_sampled_tokens):
            seq = self.slots[slot]
            seq.num_computed_tokens += n
            reaches_end = seq.num_computed_tokens == len(seq.tokens)
            expect(
                k == (1 if reaches_end else 0),
                f"step {plan.step_id}: slot {slot} sampled {k} tokens with "
                f"{seq.num_computed_tokens} "
                f"of {len(seq.tokens)} tokens computed (expected {1 if reaches_end else 0})",
            )
            if k:
                token = result.sampled_token_ids[at]
                expect(
                    token < self.facts.vocab_size,
                    f"step {plan.step_id}: slot {slot} sampled {token}, outside the vocabulary "
                    f"[0, {self.facts.vocab_size})",
                )
                seq.tokens.append(token)
                sampled[slot] = token
                at += k
        return sampled

    async def expect_rejected(self, plan: engine_pb2.BatchPlan, fields: tuple[str, ...]) -> str:
        """The plan must end the stream with INVALID_ARGUMENT whose message names one of fields."""
        try:
            await self.call.write(engine_pb2.ExecuteRequest(plan=plan))
            response = await self.call.read()
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or ""
        else:
            raise CheckFailed(
                "the engine accepted the plan"
                if response is not grpc.aio.EOF
                else "the engine closed the stream without a status code"
            )
        expect(
            code == grpc.StatusCode.INVALID_ARGUMENT,
            f"expected INVALID_ARGUMENT, got {code.name}: {details}",
        )
        expect(
            any(f in details for f in fields),
            f"INVALID_ARGUMENT {details!r} does not name the field ({' or '.join(fields)})",
        )
        return f"INVALID_ARGUMENT {details!r}"

    async def prefill(
        self, slot: int, token_ids: list[int], chunk: Optional[int] = None, **sampling
    ) -> int:
        """Registers a slot and computes its prompt (in chunks of `chunk`); the first token."""
        plan = self.plan()
        self.register(plan, slot, token_ids, **sampling)
        while True:
            seq = self.slots[slot]
            left = len(seq.tokens) - seq.num_computed_tokens
            self.schedule(plan, slot, min(left, chunk or left))
            sampled = await self.send(plan)
            if slot in sampled:
                return sampled[slot]
            plan = self.plan()

    async def decode(self, slots: list[int], steps: int) -> None:
        """`steps` one-token steps of every slot in `slots`, batched, in that order."""
        for _ in range(steps):
            plan = self.plan()
            for slot in slots:
                self.schedule(plan, slot, 1)
            await self.send(plan)

    async def close(self) -> None:
        """Half-closes and waits for the engine to end the stream (it then drops every slot)."""
        try:
            await self.call.done_writing()
            while await self.call.read() is not grpc.aio.EOF:
                pass
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            pass
        self.call.cancel()
