"""The one place the scheduler turns a step into protobuf (`to_pb`) and back (`result_from_pb`).

A plan is a diff against what the model service already holds: new sequences are registered
once; scheduled ones send only packed per-slot arrays; lifecycle lists drop state.
"""
from __future__ import annotations

import dataclasses

from planserve.v1 import common_pb2, engine_pb2
from scheduler_service.request import Request, Sampling


@dataclasses.dataclass(frozen=True)
class NewSequence:
    slot: int
    token_ids: list[int]
    sampling: Sampling
    num_computed_tokens: int


@dataclasses.dataclass
class StepPlan:
    step_id: int
    new_sequences: list[NewSequence] = dataclasses.field(default_factory=list)
    # Parallel, one entry per scheduled request (and the requests themselves, never sent).
    requests: list[Request] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: list[int] = dataclasses.field(default_factory=list)
    num_new_blocks: list[int] = dataclasses.field(default_factory=list)
    new_block_ids: list[int] = dataclasses.field(default_factory=list)
    finished_slots: list[int] = dataclasses.field(default_factory=list)
    preempted_slots: list[int] = dataclasses.field(default_factory=list)
    aborted_slots: list[int] = dataclasses.field(default_factory=list)
    copy_src: list[int] = dataclasses.field(default_factory=list)
    copy_dst: list[int] = dataclasses.field(default_factory=list)

    @property
    def total_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to tell the model service."""
        return not (self.slots or self.finished_slots or self.preempted_slots
                    or self.aborted_slots)


@dataclasses.dataclass(frozen=True)
class StepResult:
    step_id: int
    num_sampled_tokens: list[int]  # parallel to StepPlan.slots
    sampled_token_ids: list[int]
    forward_ns: int
    sample_ns: int
    total_ns: int


def _sampling_to_pb(sampling: Sampling) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed)
    if sampling.top_k > 0:
        params.top_k = sampling.top_k
    return params


def to_pb(plan: StepPlan) -> engine_pb2.ExecuteRequest:
    return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
        step_id=plan.step_id,
        new_sequences=[
            engine_pb2.NewSequence(
                slot=seq.slot, token_ids=seq.token_ids, sampling=_sampling_to_pb(seq.sampling),
                num_computed_tokens=seq.num_computed_tokens)
            for seq in plan.new_sequences
        ],
        slots=plan.slots,
        num_scheduled_tokens=plan.num_scheduled_tokens,
        num_new_blocks=plan.num_new_blocks,
        new_block_ids=plan.new_block_ids,
        finished_slots=plan.finished_slots,
        preempted_slots=plan.preempted_slots,
        aborted_slots=plan.aborted_slots,
        copy_src=plan.copy_src,
        copy_dst=plan.copy_dst,
    ))


def result_from_pb(response: engine_pb2.ExecuteResponse) -> StepResult:
    result = response.result
    return StepResult(
        step_id=result.step_id,
        num_sampled_tokens=list(result.num_sampled_tokens),
        sampled_token_ids=list(result.sampled_token_ids),
        forward_ns=result.forward_ns,
        sample_ns=result.sample_ns,
        total_ns=result.total_ns,
    )
