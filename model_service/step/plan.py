"""The plan as the model service holds it: one BatchPlan in plain arrays (PlanArrays, its new
sequences as SlotRegistrations), what a step computed (ComputedStep), the bounds a plan is checked
against (PlanLimits) and the error that names a bad field (PlanError). Protobuf stays at the edge
(model_service/batch.py); everything inside the service reads these.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np


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
class SlotRegistration:
    """One BatchPlan NewSequence as the model service registers it in a slot (the scheduler's
    side of it is scheduler_service/core/plan.py NewSequence)."""

    slot: int
    token_ids: np.ndarray  # int32
    num_computed_tokens: int
    temperature: float
    top_k: int  # 0 = off
    top_p: float
    seed: int
    processing: Optional[LogitsProcessing] = None  # None: NO_PROCESSING
    speculate: bool = False
    lora_id: int = 0  # the LoRA adapter it runs (model_service/lora/), 0: the base model


@dataclasses.dataclass(frozen=True)
class LogitsProcessing:
    """What a sequence asks beyond temperature / top-k / top-p (engine.proto NewSequence)."""

    num_prompt_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_new_tokens: int = 0
    min_tokens_suppressed_ids: tuple[int, ...] = ()
    num_logprobs: int = -1  # -1 = none
    num_prompt_logprobs: int = -1  # -1 = none

    @property
    def changes_logits(self) -> bool:
        """Whether the logits need per-sequence work before sampling."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.min_new_tokens
        )


NO_PROCESSING = LogitsProcessing()


def _empty(dtype: type, shape: tuple[int, ...] = (0,)):
    """A dataclass field that defaults to an empty array of its own."""
    return dataclasses.field(default_factory=lambda: np.zeros(shape, dtype=dtype))


@dataclasses.dataclass
class PlanArrays:
    """One BatchPlan as the model service receives it, in plain arrays (int64 unless noted); the
    scheduler's side of it is scheduler_service/core/plan.py StepPlan."""

    step_id: int
    new_sequences: list[SlotRegistration]
    slots: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_new_blocks: np.ndarray
    new_block_ids: np.ndarray
    finished_slots: np.ndarray
    preempted_slots: np.ndarray
    aborted_slots: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    # Constrained decoding: slots and their allowed-token bitmasks [len(masked_slots), words].
    masked_slots: np.ndarray = _empty(np.int64)
    allowed_token_bitmask: np.ndarray = _empty(np.uint32, (0, 0))
    # Swaps (device block -> host swap block out, host -> device in), run with the block copies.
    swap_out_src: np.ndarray = _empty(np.int64)
    swap_out_dst: np.ndarray = _empty(np.int64)
    swap_in_src: np.ndarray = _empty(np.int64)
    swap_in_dst: np.ndarray = _empty(np.int64)
    # Only slots, their token counts and new blocks (step/decode_fast.py parsed it): the runner
    # may check and apply it by the fast path.
    plain: bool = False


@dataclasses.dataclass
class ComputedStep:
    """What the model service computed in one step, sent back as a StepResult (which the
    scheduler reads as scheduler_service/core/plan.py StepResult)."""

    step_id: int
    num_sampled_tokens: np.ndarray  # parallel to PlanArrays.slots
    sampled_token_ids: np.ndarray  # flattened in slot order
    forward_ns: int
    sample_ns: int
    # engine.proto StepResult 4, 5, 9, 10 (empty unless a slot asked).
    logprobs: np.ndarray = _empty(np.float32)
    logprob_token_ids: np.ndarray = _empty(np.int64)
    prompt_logprobs: np.ndarray = _empty(np.float32)
    prompt_logprob_token_ids: np.ndarray = _empty(np.int64)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
