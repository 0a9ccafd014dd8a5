"""The one place the scheduler turns a step into protobuf (`to_pb`) and back (`result_from_pb`).

A plan is a diff against what the model service already holds: new sequences are registered
once; scheduled ones send only packed per-slot arrays; lifecycle lists drop state.

The Scheduler's C core (cython_ext/step_core.pyx) hands each plan its packed arrays already in
protobuf wire format (`StepPlan.packed.wire`); `to_pb` merges those bytes, which upb parses in
C, instead of extending four repeated fields from Python lists (several times faster at 256
decodes with protobuf 7 / upb, and array('I') and numpy extend are slower than lists: the
figures are in docs/benchmarks.md, "Figures behind the code's comments").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from cython_ext.step_core import packed_uint32_field
from planserve.v1 import common_pb2, engine_pb2
from scheduler_service.core.request import Request, Sampling


@dataclasses.dataclass(frozen=True)
class NewSequence:
    slot: int
    token_ids: list[int]
    sampling: Sampling
    num_computed_tokens: int
    num_prompt_tokens: int = 0
    min_new_tokens: int = 0
    min_tokens_suppressed_ids: tuple[int, ...] = ()
    num_logprobs: Optional[int] = None
    num_prompt_logprobs: Optional[int] = None
    speculate: bool = False
    lora_id: int = 0  # the adapter, as loaded by LoadAdapter; 0: the base model


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
    # Preemption by swap (scheduler_service/core/swap.py): device blocks out to host swap blocks,
    # host swap blocks back in to fresh device blocks; run with the copies, before the forward.
    swap_out_src: list[int] = dataclasses.field(default_factory=list)
    swap_out_dst: list[int] = dataclasses.field(default_factory=list)
    swap_in_src: list[int] = dataclasses.field(default_factory=list)
    swap_in_dst: list[int] = dataclasses.field(default_factory=list)
    # Structured output (scheduler_service/text/structured.py): the slots that must sample from an
    # allowed set this step, and their bitmasks (ceil(vocab / 32) little-endian uint32 each).
    masked_slots: list[int] = dataclasses.field(default_factory=list)
    allowed_token_bitmask: bytes = b""
    # The C core's copy of slots, num_scheduled_tokens, num_new_blocks and new_block_ids
    # (a cython_ext.step_core.PackedPlan: the wire encoding, and what update() reads); None for
    # plans built in Python, whose lists are then encoded field by field.
    packed: Optional[Any] = dataclasses.field(default=None, repr=False, compare=False)
    # Overlap (Scheduler.commit): entry index -> index of the placeholder token it reserved (None
    # for a constrained sequence, whose token is appended when it comes), and entry index ->
    # computed count at planning time for prompt-logprob requests.
    placeholders: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    prompt_starts: Optional[dict] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def total_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to tell the model service."""
        return not (self.slots or self.finished_slots or self.preempted_slots or self.aborted_slots)


@dataclasses.dataclass(frozen=True)
class StepResult:
    step_id: int
    num_sampled_tokens: list[int]  # parallel to StepPlan.slots
    sampled_token_ids: list[int]
    forward_ns: int
    sample_ns: int
    total_ns: int
    # Flat logprob arrays (engine.proto StepResult 4, 5, 9, 10); empty unless asked for.
    logprobs: list[float] = dataclasses.field(default_factory=list)
    logprob_token_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_logprob_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


def _sampling_to_pb(sampling: Sampling) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed
    )
    if sampling.top_k > 0:
        params.top_k = sampling.top_k
    # Unset means off on the model side; only what a request changed travels.
    if sampling.min_p:
        params.min_p = sampling.min_p
    if sampling.repetition_penalty != 1.0:
        params.repetition_penalty = sampling.repetition_penalty
    if sampling.presence_penalty:
        params.presence_penalty = sampling.presence_penalty
    if sampling.frequency_penalty:
        params.frequency_penalty = sampling.frequency_penalty
    if sampling.logit_bias:
        params.logit_bias.update(dict(sampling.logit_bias))
    return params


_TOKEN_IDS_FIELD = engine_pb2.NewSequence.DESCRIPTOR.fields_by_name["token_ids"].number


def _add_new_sequence(batch: engine_pb2.BatchPlan, seq: NewSequence) -> None:
    # Added in place (extend would copy each message) and the token ids, thousands per prompt,
    # merged from their wire encoding (protobuf converts a list one int at a time, ~25 ns each).
    message = batch.new_sequences.add(
        slot=seq.slot,
        sampling=_sampling_to_pb(seq.sampling),
        num_computed_tokens=seq.num_computed_tokens,
        num_prompt_tokens=seq.num_prompt_tokens,
    )
    message.MergeFromString(packed_uint32_field(_TOKEN_IDS_FIELD, seq.token_ids))
    if seq.min_new_tokens:
        message.min_new_tokens = seq.min_new_tokens
        message.min_tokens_suppressed_ids.extend(seq.min_tokens_suppressed_ids)
    if seq.num_logprobs is not None:
        message.num_logprobs = seq.num_logprobs
    if seq.num_prompt_logprobs is not None:
        message.num_prompt_logprobs = seq.num_prompt_logprobs
    if seq.speculate:
        message.speculate = True
    if seq.lora_id:
        message.lora_id = seq.lora_id


def to_pb(plan: StepPlan) -> engine_pb2.ExecuteRequest:
    request = engine_pb2.ExecuteRequest()
    batch = request.plan
    if plan.packed is not None:
        batch.MergeFromString(plan.packed.wire)  # fields 3-6, encoded by the C core
    else:
        batch.slots.extend(plan.slots)
        batch.num_scheduled_tokens.extend(plan.num_scheduled_tokens)
        batch.num_new_blocks.extend(plan.num_new_blocks)
        batch.new_block_ids.extend(plan.new_block_ids)
    batch.step_id = plan.step_id
    if plan.new_sequences:
        for seq in plan.new_sequences:
            _add_new_sequence(batch, seq)
    # Lifecycle lists and copies are short and usually empty.
    if plan.finished_slots:
        batch.finished_slots.extend(plan.finished_slots)
    if plan.preempted_slots:
        batch.preempted_slots.extend(plan.preempted_slots)
    if plan.aborted_slots:
        batch.aborted_slots.extend(plan.aborted_slots)
    if plan.copy_src:
        batch.copy_src.extend(plan.copy_src)
        batch.copy_dst.extend(plan.copy_dst)
    if plan.swap_out_src:
        batch.swap_out_src.extend(plan.swap_out_src)
        batch.swap_out_dst.extend(plan.swap_out_dst)
    if plan.swap_in_src:
        batch.swap_in_src.extend(plan.swap_in_src)
        batch.swap_in_dst.extend(plan.swap_in_dst)
    if plan.masked_slots:
        batch.masked_slots.extend(plan.masked_slots)
        batch.allowed_token_bitmask = plan.allowed_token_bitmask
    return request


def result_from_pb(response: engine_pb2.ExecuteResponse) -> StepResult:
    result = response.result
    return StepResult(
        step_id=result.step_id,
        num_sampled_tokens=list(result.num_sampled_tokens),
        sampled_token_ids=list(result.sampled_token_ids),
        forward_ns=result.forward_ns,
        sample_ns=result.sample_ns,
        total_ns=result.total_ns,
        logprobs=list(result.logprobs),
        logprob_token_ids=list(result.logprob_token_ids),
        prompt_logprobs=list(result.prompt_logprobs),
        prompt_logprob_token_ids=list(result.prompt_logprob_token_ids),
        num_draft_tokens=result.num_draft_tokens,
        num_accepted_draft_tokens=result.num_accepted_draft_tokens,
    )
