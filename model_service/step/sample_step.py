"""A step's sampling, after the runner's one forward: the logits of the sample rows processed
(penalties, bias, min tokens: model_service/step/logits.py) and masked (grammars) where a slot asks,
then sampled (model_service/step/sampler.py), with the logprobs of the slots that asked for them.
"""

from __future__ import annotations

import numpy as np
import torch

from model_service.step.logits import apply_masks, apply_processing, gather_logprobs
from model_service.step.plan import ComputedStep, PlanArrays
from model_service.step.sampler import SamplingBatch, sample
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
    raw = logits
    processed = table.changes_logits[sample_slots].nonzero()[0]
    if processed.size or plan.masked_slots.size:
        logits = logits.clone()
        if processed.size:
            apply_processing(logits, processed, sample_slots[processed], table)
        if plan.masked_slots.size:
            row_of_slot = {slot: row for row, slot in enumerate(sample_slots.tolist())}
            rows = np.array(
                [row_of_slot[slot] for slot in plan.masked_slots.tolist()], dtype=np.int64
            )  # slot_checks: all sample
            apply_masks(logits, rows, plan.allowed_token_bitmask, raw)
    sampled = sample(logits, sampling_batch(table, sample_slots)).cpu().numpy().astype(np.int64)
    logprob_rows = (table.num_logprobs[sample_slots] >= 0).nonzero()[0]
    if logprob_rows.size:
        output.logprobs, output.logprob_token_ids = gather_logprobs(
            raw[torch.from_numpy(logprob_rows).to(raw.device)],
            sampled[logprob_rows],
            table.num_logprobs[sample_slots[logprob_rows]],
        )
    return sampled


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
