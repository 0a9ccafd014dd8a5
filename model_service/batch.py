"""The model service's protobuf edge, both ways: ExecuteRequest -> PlanArrays (from_pb),
ComputedStep -> ExecuteResponse (result_to_pb), DescribedFacts -> DescribeResponse (facts_to_pb).

Nothing else in model_service imports the generated stubs. Stateless checks (array lengths, id
ranges) happen here; checks against the slot state happen in the runner before any state changes.
Both raise PlanError(field, message); the server maps it to INVALID_ARGUMENT "field: message".
"""

from __future__ import annotations

import secrets

import numpy as np

from model_service.step.plan import (
    ComputedStep,
    LogitsProcessing,
    PlanArrays,
    PlanError,
    PlanLimits,
    SlotRegistration,
)
from planserve.contract import CONTRACT_VERSION, REQUEST_BOUNDS
from planserve.v1 import engine_pb2

# Most of a decode plan's repeated fields are empty; they share one empty array (a size-0 array
# cannot be written through) instead of converting each.
_NONE = np.zeros(0, dtype=np.int64)


def _arr(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64) if len(values) else _NONE


def _check_range(field: str, values: np.ndarray, low: int, high: int) -> None:
    if values.size and (values.min() < low or values.max() >= high):
        bad = values[(values < low) | (values >= high)][0]
        raise PlanError(field, f"{bad} is outside [{low}, {high})")


def _has_repeat(values: np.ndarray, high: int) -> bool:
    """Whether an id occurs twice in `values` (all in [0, high), checked before)."""
    return values.size > 1 and int(np.bincount(values, minlength=high).max()) > 1


def _new_sequence(index: int, msg, limits: PlanLimits) -> SlotRegistration:
    field = f"new_sequences[{index}]"
    tokens = np.asarray(msg.token_ids, dtype=np.int64)
    if tokens.size == 0:
        raise PlanError(f"{field}.token_ids", "must not be empty")
    if tokens.size > limits.max_model_len:
        raise PlanError(
            f"{field}.token_ids",
            f"{tokens.size} tokens exceed max_model_len {limits.max_model_len}",
        )
    _check_range(f"{field}.token_ids", tokens, 0, limits.vocab_size)
    _check_range(f"{field}.slot", _arr([msg.slot]), 0, limits.max_num_slots)
    if msg.num_computed_tokens >= tokens.size:
        # At least one known token must still be computed, or nothing could produce the next one.
        raise PlanError(
            f"{field}.num_computed_tokens",
            f"{msg.num_computed_tokens} must be below len(token_ids) {tokens.size}",
        )
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
    processing = _processing(field, msg, tokens.size, limits)
    # Speculation only where the rule needs no per-token state: no logits processing, no logprobs.
    speculate = msg.speculate and not processing.changes_logits and processing.num_logprobs < 0
    return SlotRegistration(
        msg.slot,
        tokens.astype(np.int32),
        msg.num_computed_tokens,
        float(temperature),
        int(top_k),
        float(top_p),
        int(seed),
        processing,
        speculate,
        int(msg.lora_id),
    )


def _bounded(field: str, value: float, low: float, high: float) -> float:
    if not low <= value <= high:  # NaN fails too
        raise PlanError(field, f"{value} is outside [{low:g}, {high:g}]")
    return float(value)


def _processing(field: str, msg, num_tokens: int, limits: PlanLimits) -> LogitsProcessing:
    s = msg.sampling
    if msg.num_prompt_tokens > num_tokens:
        raise PlanError(
            f"{field}.num_prompt_tokens",
            f"{msg.num_prompt_tokens} exceeds len(token_ids) {num_tokens}",
        )
    suppressed = _arr(msg.min_tokens_suppressed_ids)
    _check_range(f"{field}.min_tokens_suppressed_ids", suppressed, 0, limits.vocab_size)
    bounds = REQUEST_BOUNDS
    if len(s.logit_bias) > bounds.max_logit_bias_entries:
        raise PlanError(
            f"{field}.sampling.logit_bias",
            f"{len(s.logit_bias)} entries exceed {bounds.max_logit_bias_entries}",
        )
    bias_ids = _arr(list(s.logit_bias.keys()))
    _check_range(f"{field}.sampling.logit_bias", bias_ids, 0, limits.vocab_size)
    most_bias = bounds.max_logit_bias
    for token_id, bias in s.logit_bias.items():
        _bounded(f"{field}.sampling.logit_bias[{token_id}]", bias, -most_bias, most_bias)
    for name in ("num_logprobs", "num_prompt_logprobs"):
        if msg.HasField(name) and getattr(msg, name) > bounds.max_top_logprobs:
            raise PlanError(
                f"{field}.{name}", f"{getattr(msg, name)} exceeds {bounds.max_top_logprobs}"
            )
    repetition_penalty = 1.0
    if s.HasField("repetition_penalty"):
        repetition_penalty = s.repetition_penalty
        if not 0 < repetition_penalty <= bounds.max_repetition_penalty:  # NaN fails too
            raise PlanError(
                f"{field}.sampling.repetition_penalty",
                f"{repetition_penalty} is outside (0, {bounds.max_repetition_penalty:g}]",
            )
    return LogitsProcessing(
        num_prompt_tokens=msg.num_prompt_tokens or num_tokens,
        min_p=_bounded(f"{field}.sampling.min_p", s.min_p, 0.0, 1.0),
        repetition_penalty=repetition_penalty,
        presence_penalty=_bounded(
            f"{field}.sampling.presence_penalty",
            s.presence_penalty,
            -bounds.max_penalty,
            bounds.max_penalty,
        ),
        frequency_penalty=_bounded(
            f"{field}.sampling.frequency_penalty",
            s.frequency_penalty,
            -bounds.max_penalty,
            bounds.max_penalty,
        ),
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_new_tokens=msg.min_new_tokens,
        min_tokens_suppressed_ids=tuple(suppressed.tolist()),
        num_logprobs=msg.num_logprobs if msg.HasField("num_logprobs") else -1,
        num_prompt_logprobs=msg.num_prompt_logprobs if msg.HasField("num_prompt_logprobs") else -1,
    )


def from_pb(request: engine_pb2.ExecuteRequest, limits: PlanLimits) -> PlanArrays:
    """Convert and check one ExecuteRequest; raises PlanError naming the field."""
    if not request.HasField("plan"):
        raise PlanError("plan", "missing")
    p = request.plan
    plan = PlanArrays(
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
        masked_slots=_arr(p.masked_slots),
        allowed_token_bitmask=_bitmasks(p, limits),
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
        raise PlanError(
            "new_block_ids",
            f"length {plan.new_block_ids.size} != sum(num_new_blocks) {plan.num_new_blocks.sum()}",
        )
    if plan.copy_src.size != plan.copy_dst.size:
        raise PlanError(
            "copy_dst", f"length {plan.copy_dst.size} != len(copy_src) {plan.copy_src.size}"
        )
    for name in ("slots", "finished_slots", "preempted_slots", "aborted_slots"):
        _check_range(name, getattr(plan, name), 0, limits.max_num_slots)
    for name in ("new_block_ids", "copy_src", "copy_dst"):
        _check_range(name, getattr(plan, name), 1, limits.num_kv_blocks)  # block 0 is reserved
    if n and plan.num_scheduled_tokens.min() < 1:
        raise PlanError("num_scheduled_tokens", "every scheduled slot needs >= 1 token")
    if _has_repeat(plan.slots, limits.max_num_slots):
        raise PlanError("slots", "a slot is scheduled twice")
    if plan.masked_slots.size:
        _check_masked(plan)
    return plan


def _check_masked(plan: PlanArrays) -> None:
    if np.unique(plan.masked_slots).size != plan.masked_slots.size:
        raise PlanError("masked_slots", "a slot is masked twice")
    if not np.isin(plan.masked_slots, plan.slots).all():
        raise PlanError(
            "masked_slots",
            f"slot {plan.masked_slots[~np.isin(plan.masked_slots, plan.slots)][0]} is not "
            "scheduled in this plan",
        )


def _bitmasks(p, limits: PlanLimits) -> np.ndarray:
    """BatchPlan.allowed_token_bitmask as [len(masked_slots), words] uint32."""
    words = -(-limits.vocab_size // 32)
    expected = len(p.masked_slots) * words * 4
    if len(p.allowed_token_bitmask) != expected:
        raise PlanError(
            "allowed_token_bitmask",
            f"{len(p.allowed_token_bitmask)} bytes; {len(p.masked_slots)} masked slots need "
            f"{expected}",
        )
    if not expected:
        return np.zeros((0, words), dtype=np.uint32)
    masks = np.frombuffer(p.allowed_token_bitmask, dtype="<u4").reshape(len(p.masked_slots), words)
    # Every mask must allow some token inside the vocabulary, or nothing could be sampled.
    tail = limits.vocab_size % 32
    usable = masks.copy()
    if tail:
        usable[:, -1] &= np.uint32((1 << tail) - 1)
    empty = ~usable.any(axis=1)
    if empty.any():
        raise PlanError(
            "allowed_token_bitmask",
            f"the mask of masked slot {p.masked_slots[int(np.argmax(empty))]} allows no token",
        )
    return usable


def result_to_pb(output: ComputedStep, total_ns: int) -> engine_pb2.ExecuteResponse:
    response = engine_pb2.ExecuteResponse()
    r = response.result
    r.step_id = output.step_id
    r.num_sampled_tokens.extend(output.num_sampled_tokens.tolist())
    r.sampled_token_ids.extend(output.sampled_token_ids.tolist())
    r.forward_ns = output.forward_ns
    r.sample_ns = output.sample_ns
    r.total_ns = total_ns
    if output.logprobs.size:
        r.logprobs.extend(output.logprobs.tolist())
        r.logprob_token_ids.extend(output.logprob_token_ids.tolist())
    r.num_draft_tokens = output.num_draft_tokens
    r.num_accepted_draft_tokens = output.num_accepted_draft_tokens
    if output.prompt_logprobs.size:
        r.prompt_logprobs.extend(output.prompt_logprobs.tolist())
        r.prompt_logprob_token_ids.extend(output.prompt_logprob_token_ids.tolist())
    return response


def _check_swaps(plan: PlanArrays, limits: PlanLimits) -> None:
    """Swap ids: device blocks in [1, num_kv_blocks), host blocks in [0, num_swap_blocks), pairs of
    equal length, and no destination written twice in one plan."""
    if not (plan.swap_out_src.size or plan.swap_out_dst.size):
        if not (plan.swap_in_src.size or plan.swap_in_dst.size):
            return
    for src, dst in (("swap_out_src", "swap_out_dst"), ("swap_in_src", "swap_in_dst")):
        if getattr(plan, src).size != getattr(plan, dst).size:
            raise PlanError(
                dst, f"length {getattr(plan, dst).size} != len({src}) {getattr(plan, src).size}"
            )
    for name, high, low in (
        ("swap_out_src", limits.num_kv_blocks, 1),
        ("swap_out_dst", limits.num_swap_blocks, 0),
        ("swap_in_src", limits.num_swap_blocks, 0),
        ("swap_in_dst", limits.num_kv_blocks, 1),
    ):
        _check_range(name, getattr(plan, name), low, high)
    for name in ("swap_out_dst", "swap_in_dst"):
        if np.unique(getattr(plan, name)).size != getattr(plan, name).size:
            raise PlanError(name, "a block is written twice")


def facts_to_pb(facts) -> engine_pb2.DescribeResponse:
    """described.DescribedFacts -> DescribeResponse, with the contract's version and bounds."""
    bounds = REQUEST_BOUNDS
    response = engine_pb2.DescribeResponse(
        contract_version=CONTRACT_VERSION,
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
        max_top_logprobs=bounds.max_top_logprobs,
        request_bounds=engine_pb2.RequestBounds(
            max_logit_bias_entries=bounds.max_logit_bias_entries,
            max_logit_bias=bounds.max_logit_bias,
            max_repetition_penalty=bounds.max_repetition_penalty,
            max_penalty=bounds.max_penalty,
        ),
        features=engine_pb2.EngineFeatures(
            chunked_prefill=facts.chunked_prefill,
            block_copy=facts.block_copy,
            swap=getattr(facts, "num_swap_blocks", 0) > 0,
            speculation=getattr(facts, "num_speculative_tokens", 0) > 0,
        ),
        num_swap_blocks=getattr(facts, "num_swap_blocks", 0),
        num_speculative_tokens=getattr(facts, "num_speculative_tokens", 0),
        step_token_budget=getattr(facts, "step_token_budget", 0),
        step_max_seqs=getattr(facts, "step_max_seqs", 0),
        compute=getattr(facts, "compute", {}),
    )
    lora = getattr(facts, "lora", None)
    if lora is not None:  # LoraFacts: unset when the engine serves no adapters
        response.lora.CopyFrom(
            engine_pb2.LoraCapacity(
                max_loras=lora.max_loras,
                max_lora_rank=lora.max_lora_rank,
                max_cpu_loras=lora.max_cpu_loras,
                target_modules=list(lora.target_modules),
            )
        )
    if facts.bos_token_id is not None:
        response.bos_token_id = facts.bos_token_id
    return response
