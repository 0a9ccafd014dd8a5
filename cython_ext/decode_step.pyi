"""Python view of cython_ext/decode_step.pyx (the plain step's C loops; no C callers)."""
import numpy as np
import numpy.typing as npt

CHECK_FAILED: int
"""check_decode: a check failed; nothing was changed."""
CHECKED: int
"""check_decode: applied; some scheduled slot samples with more than a plain argmax."""
CHECKED_GREEDY: int
"""check_decode: applied; every scheduled slot is greedy, with no logits processing or logprobs."""

def parse_decode_plan(
    wire: bytes, max_num_slots: int, num_kv_blocks: int
) -> (
    tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]
    | None
):
    """A BatchPlan's wire bytes -> (step_id, slots, num_scheduled_tokens, num_new_blocks,
    new_block_ids) when the plan holds nothing else (but `extension`), schedules at least one slot
    and passes batch.from_pb's checks of those fields; else None."""

def parse_decode_request(
    wire: bytes, max_num_slots: int, num_kv_blocks: int
) -> (
    tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]
    | None
):
    """parse_decode_plan of an ExecuteRequest's wire bytes: None unless they hold the plan alone."""

def check_decode(
    table: object,
    slots: npt.NDArray[np.int64],
    num_scheduled: npt.NDArray[np.int64],
    num_new_blocks: npt.NDArray[np.int64],
    new_block_ids: npt.NDArray[np.int64],
    max_model_len: int,
    block_size: int,
) -> int:
    """slot_checks.check_plan for a parsed plain plan (speculation off) against `table` (a
    SlotTable), then its new block ids appended: CHECK_FAILED (table unchanged), CHECKED or
    CHECKED_GREEDY."""

def advance(
    table: object,
    slots: npt.NDArray[np.int64],
    context_lens: npt.NDArray[np.int64],
    sample_slots: npt.NDArray[np.int64],
    sampled_token_ids: npt.NDArray[np.int64],
) -> None:
    """num_computed[slots] = context_lens; each sample slot's token appended. ValueError, with
    nothing changed, for mismatched lengths, a slot outside the table or a full token row."""

def encode_result(
    step_id: int,
    num_sampled_tokens: npt.NDArray[np.int64],
    sampled_token_ids: npt.NDArray[np.int64],
    forward_ns: int,
    sample_ns: int,
    total_ns: int,
    num_draft_tokens: int,
    num_accepted_draft_tokens: int,
) -> bytes:
    """ExecuteResponse wire bytes of a StepResult with these fields (no logprobs), byte for byte
    what batch.result_to_pb's message serializes to. ValueError for a value outside uint32."""
