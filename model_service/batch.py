"""The model service's protobuf edge: ExecuteRequest -> StepPlan, StepOutput -> ExecuteResponse.

Nothing else in model_service imports the generated stubs. Stateless checks (array lengths, id
ranges) happen here; checks against the slot state happen in the runner before any state changes.
Both raise PlanError(field, message); the server maps it to INVALID_ARGUMENT "field: message".
"""

from __future__ import annotations

import dataclasses
import secrets

import numpy as np

from planserve.v1 import engine_pb2


class PlanError(ValueError):
    """A plan the model service cannot apply; `field` names the offending BatchPlan field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True)
class PlanLimits:
    """Bounds a plan is checked against (the facts this service reported in Describe)."""

    vocab_size: int
    num_kv_blocks: int
    max_num_slots: int
    max_model_len: int
    num_swap_blocks: int = 0


@dataclasses.dataclass
class NewSequenceData:
    slot: int
    token_ids: np.ndarray  # int32
    num_computed_tokens: int
    temperature: float
    top_k: int  # 0 = off
    top_p: float
    seed: int


@dataclasses.dataclass
class StepPlan:
    """One BatchPlan as plain arrays (int64 unless noted)."""

    step_id: int
    new_sequences: list[NewSequenceData]
    slots: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_new_blocks: np.ndarray
    new_block_ids: np.ndarray
    finished_slots: np.ndarray
    preempted_slots: np.ndarray
    aborted_slots: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    # Swaps (device block -> host swap block out, host -> device in), run with the block copies.
    swap_out_src: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    swap_out_dst: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    swap_in_src: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    swap_in_dst: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclasses.dataclass
class StepOutput:
    step_id: int
    num_sampled_tokens: np.ndarray  # parallel to StepPlan.slots
    sampled_token_ids: np.ndarray  # flattened in slot order
    forward_ns: int
    sample_ns: int


def _arr(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _check_range(field: str, values: np.ndarray, low: int, high: int) -> None:
    if values.size and (values.min() < low or values.max() >= high):
        bad = values[(values < low) | (values >= high)][0]
        raise PlanError(field, f"{bad} is outside [{low}, {high})")


def _new_sequence(index: int, msg, limits: PlanLimits) -> NewSequenceData:
    field = f"new_sequences[{index}]"
    tokens = np.asarray(msg.token_ids, dtype=np.int64)
    if tokens.size == 0:
        raise PlanError(f"{field}.token_ids", "must not be empty")
    if tokens.size > limits.max_model_len:
        raise PlanError(f"{field}.token_ids", f"{tokens.size} tokens exceed max_model_len {limits.max_model_len}")
    _check_range(f"{field}.token_ids", tokens, 0, limits.vocab_size)
    _check_range(f"{field}.slot", _arr([msg.slot]), 0, limits.max_num_slots)
    if msg.num_computed_tokens >= tokens.size:
        # At least one known token must still be computed, or nothing could produce the next one.
        raise PlanError(f"{field}.num_computed_tokens", f"{msg.num_computed_tokens} must be below len(token_ids) {tokens.size}")
    s = msg.sampling
    temperature = s.temperature if s.HasField("temperature") else 1.0
    top_k = s.top_k if s.HasField("top_k") else 0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (temperature >= 0.0 and np.isfinite(temperature)):
        raise PlanError(f"{field}.sampling.temperature", f"{temperature} must be >= 0")
    if s.HasField("top_k") and top_k < 1:
        raise PlanError(f"{field}.sampling.top_k", f"{top_k} must be >= 1 when set")
    if not 0.0 < top_p <= 1.0:
        raise PlanError(f"{field}.sampling.top_p", f"{top_p} must be in (0, 1]")
    # The scheduler always sets the seed; a missing one gets a random seed, as the contract says.
    seed = s.seed if s.HasField("seed") else secrets.randbits(64)
    return NewSequenceData(msg.slot, tokens.astype(np.int32), msg.num_computed_tokens, float(temperature), int(top_k), float(top_p), int(seed))


def from_pb(request: engine_pb2.ExecuteRequest, limits: PlanLimits) -> StepPlan:
    """Convert and check one ExecuteRequest; raises PlanError naming the field."""
    if not request.HasField("plan"):
        raise PlanError("plan", "missing")
    p = request.plan
    plan = StepPlan(
        step_id=p.step_id,
        new_sequences=[_new_sequence(i, ns, limits) for i, ns in enumerate(p.new_sequences)],
        slots=_arr(p.slots),
        num_scheduled_tokens=_arr(p.num_scheduled_tokens),
        num_new_blocks=_arr(p.num_new_blocks),
        new_block_ids=_arr(p.new_block_ids),
        finished_slots=_arr(p.finished_slots),
        preempted_slots=_arr(p.preempted_slots),
        aborted_slots=_arr(p.aborted_slots),
        copy_src=_arr(p.copy_src),
        copy_dst=_arr(p.copy_dst),
        swap_out_src=_arr(p.swap_out_src),
        swap_out_dst=_arr(p.swap_out_dst),
        swap_in_src=_arr(p.swap_in_src),
        swap_in_dst=_arr(p.swap_in_dst),
    )
    _check_swaps(plan, limits)
    n = plan.slots.size
    for name in ("num_scheduled_tokens", "num_new_blocks"):
        if getattr(plan, name).size != n:
            raise PlanError(name, f"length {getattr(plan, name).size} != len(slots) {n}")
    if plan.new_block_ids.size != plan.num_new_blocks.sum():
        raise PlanError("new_block_ids", f"length {plan.new_block_ids.size} != sum(num_new_blocks) {plan.num_new_blocks.sum()}")
    if plan.copy_src.size != plan.copy_dst.size:
        raise PlanError("copy_dst", f"length {plan.copy_dst.size} != len(copy_src) {plan.copy_src.size}")
    for name in ("slots", "finished_slots", "preempted_slots", "aborted_slots"):
        _check_range(name, getattr(plan, name), 0, limits.max_num_slots)
    for name in ("new_block_ids", "copy_src", "copy_dst"):
        _check_range(name, getattr(plan, name), 1, limits.num_kv_blocks)  # block 0 is reserved
    if n and plan.num_scheduled_tokens.min() < 1:
        raise PlanError("num_scheduled_tokens", "every scheduled slot needs >= 1 token")
    if np.unique(plan.slots).size != n:
        raise PlanError("slots", "a slot is scheduled twice")
    return plan


def result_to_pb(output: StepOutput, total_ns: int) -> engine_pb2.ExecuteResponse:
    response = engine_pb2.ExecuteResponse()
    r = response.result
    r.step_id = output.step_id
    r.num_sampled_tokens.extend(output.num_sampled_tokens.tolist())
    r.sampled_token_ids.extend(output.sampled_token_ids.tolist())
    r.forward_ns = output.forward_ns
    r.sample_ns = output.sample_ns
    r.total_ns = total_ns
    return response


def _check_swaps(plan: StepPlan, limits: PlanLimits) -> None:
    """Swap ids: device blocks in [1, num_kv_blocks), host blocks in [0, num_swap_blocks), pairs of
    equal length, and no destination written twice in one plan."""
    for src, dst in (("swap_out_src", "swap_out_dst"), ("swap_in_src", "swap_in_dst")):
        if getattr(plan, src).size != getattr(plan, dst).size:
            raise PlanError(dst, f"length {getattr(plan, dst).size} != len({src}) {getattr(plan, src).size}")
    for name, high, low in (("swap_out_src", limits.num_kv_blocks, 1), ("swap_out_dst", limits.num_swap_blocks, 0),
                            ("swap_in_src", limits.num_swap_blocks, 0), ("swap_in_dst", limits.num_kv_blocks, 1)):
        _check_range(name, getattr(plan, name), low, high)
    for name in ("swap_out_dst", "swap_in_dst"):
        if np.unique(getattr(plan, name)).size != getattr(plan, name).size:
            raise PlanError(name, "a block is written twice")


def facts_to_pb(facts) -> engine_pb2.DescribeResponse:
    """runner.EngineFacts -> DescribeResponse (contract version 1)."""
    response = engine_pb2.DescribeResponse(
        contract_version=1,
        model_name=facts.model_name,
        architecture=facts.architecture,
        dtype=facts.dtype,
        device=facts.device,
        vocab_size=facts.vocab_size,
        max_model_len=facts.max_model_len,
        block_size=facts.block_size,
        num_kv_blocks=facts.num_kv_blocks,
        max_num_slots=facts.max_num_slots,
        eos_token_ids=facts.eos_token_ids,
        tokenizer_json=facts.tokenizer_json,
        chat_template=facts.chat_template,
        special_tokens=facts.special_tokens,
        features=engine_pb2.EngineFeatures(
            chunked_prefill=facts.chunked_prefill, block_copy=facts.block_copy,
            swap=getattr(facts, "num_swap_blocks", 0) > 0, speculation=False
        ),
        num_swap_blocks=getattr(facts, "num_swap_blocks", 0),
    )
    if facts.bos_token_id is not None:
        response.bos_token_id = facts.bos_token_id
    return response
