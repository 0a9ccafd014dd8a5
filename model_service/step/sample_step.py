"""A step's sampling, after the runner's one forward: the logits of the sample rows processed
(penalties, bias, min tokens: model_service/step/logits.py) and masked (grammars) where a slot asks,
then sampled (model_service/step/sampler.py), with the logprobs of the slots that asked for them.
Everything up to the sampled ids stays on the device (`sample_on_device`): a step launched ahead
(step/launch_ahead.py) copies them back later; the runner's own steps read them at once.
"""

from __future__ import annotations

import numpy as np
import torch

from model_service.step.logits import RowLogprobs, apply_masks, apply_processing, row_logprobs
from model_service.step.plan import ComputedStep, PlanArrays
from model_service.step.sampler import SamplingBatch, argmax_rows, on_device, sample
from model_service.step.slot_table import SlotTable


def sample_rows(
    logits: torch.Tensor,
    sample_slots: np.ndarray,
    plan: PlanArrays,
    table: SlotTable,
    output: ComputedStep,
) -> np.ndarray:
    """Logits processing, sampling and logprobs for the sample rows; returns the token ids
    (and fills output's logprob arrays)."""
    sampled, logprobs = sample_on_device(logits, sample_slots, plan, table, greedy=False)
    if logprobs is not None:
        output.logprobs, output.logprob_token_ids = logprobs.flat()
    return sampled.cpu().numpy().astype(np.int64)


def sample_on_device(
    logits: torch.Tensor,
    sample_slots: np.ndarray,
    plan: PlanArrays,
    table: SlotTable,
    greedy: bool,
    in_flight: tuple[np.ndarray, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, RowLogprobs | None]:
    """The sample rows' token ids and the logprobs of the rows that asked, on the logits'
    device, no host sync (`greedy`: every slot samples by a plain argmax, no logprobs;
    `in_flight`: per sample row, the index of its last token among the ids of the step still
    on the device, or -1, and those ids: logits.apply_processing)."""
    if greedy:
        return argmax_rows(logits), None
    raw = logits
    processed = table.changes_logits[sample_slots].nonzero()[0]
    if processed.size or plan.masked_slots.size:
        logits = logits.clone()
        if processed.size:
            late = None if in_flight is None else (in_flight[0][processed], in_flight[1])
            apply_processing(logits, processed, sample_slots[processed], table, late)
        if plan.masked_slots.size:
            row_of_slot = {slot: row for row, slot in enumerate(sample_slots.tolist())}
            rows = np.array(
                [row_of_slot[slot] for slot in plan.masked_slots.tolist()], dtype=np.int64
            )  # slot_checks: all sample
            apply_masks(logits, rows, plan.allowed_token_bitmask, raw)
    sampled = sample(logits, sampling_batch(table, sample_slots))
    logprob_rows = (table.num_logprobs[sample_slots] >= 0).nonzero()[0]
    if not logprob_rows.size:
        return sampled, None
    index = on_device(raw.device, logprob_rows)
    counts = table.num_logprobs[sample_slots[logprob_rows]]
    return sampled, row_logprobs(raw.index_select(0, index), sampled[index], counts)


def sampling_batch(table: SlotTable, sample_slots: np.ndarray) -> SamplingBatch:
    """The sample slots' parameters, each drawing at its next position (the slot's known tokens:
    the reproducibility rule's position, model_service/step/sampler.py)."""
    return SamplingBatch(
        temperature=table.temperature[sample_slots],
        top_k=table.top_k[sample_slots],
        top_p=table.top_p[sample_slots],
        seed=table.seed[sample_slots],
        position=table.num_tokens[sample_slots],
        min_p=table.min_p[sample_slots],
    )
