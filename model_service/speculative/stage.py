"""Speculative decoding as one stage around the runner's step (the rule itself, and the drafters,
are model_service/speculative/verify.py and model_service/speculative/draft_model.py):

    propose   decoding slots granted 1 + k tokens get up to k drafts appended to their known
              tokens for this step (plan index -> Draft)
    run       the runner's step (inputs, forward, sampling, the slot table advanced), asked for
              the logits of every drafted position beside its sample rows
    verify    {plan index: (emitted tokens, drafts accepted)}: the target at a slot's drafted
              positions is its draft rows, one past them its ordinary sample row
    apply     what verification emitted replaces the plain sample of those slots

Without a drafter, or when no slot drafts this step, the stage is the plain step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol

import numpy as np
import torch

from model_service.speculative.verify import Draft, uniforms, verify, verify_greedy
from model_service.step.plan import ComputedStep
from model_service.step.sampler import SamplingBatch, filtered_probs
from model_service.step.slot_table import SlotTable


class Drafter(Protocol):
    """What proposes drafts: verify.NgramDrafter, draft_model.DraftModelDrafter."""

    def on_register(self, slot: int) -> None: ...

    def propose_batch(
        self, slot_table: SlotTable, slots: np.ndarray, rooms: np.ndarray
    ) -> list[Draft]: ...


@dataclasses.dataclass
class StepRun:
    """What the runner's step hands back to the stage: its result, and the logits verification
    reads (sample rows in the order of sample_slots; drafted rows in plan order)."""

    output: ComputedStep
    sample_slots: np.ndarray
    sample_logits: torch.Tensor
    draft_logits: torch.Tensor


# run(n, num_tokens, draft_rows): computes n[b] tokens of each scheduled slot, with num_tokens
# the known tokens per slot (drafts included); draft_rows(query_start) gives the packed rows of
# the drafted positions, whose logits go into StepRun.draft_logits.
RunStep = Callable[[np.ndarray, np.ndarray, Callable[[np.ndarray], np.ndarray]], StepRun]


class SpeculationStage:
    def __init__(self, drafter: Optional[Drafter], table: SlotTable, max_model_len: int) -> None:
        self.drafter = drafter
        self.table = table
        self.max_model_len = max_model_len

    def register(self, slot: int, speculate: bool) -> None:
        """A new sequence in `slot`; it drafts when it asked to and a drafter exists."""
        self.table.speculate[slot] = speculate and self.drafter is not None
        if self.drafter is not None:
            self.drafter.on_register(slot)

    def around(self, slots: np.ndarray, n: np.ndarray, run: RunStep) -> ComputedStep:
        """One step of the scheduled `slots` (n[b] tokens each): propose, run, verify, apply."""
        drafts, n, num_tokens = self._propose(slots, n)
        result = run(n, num_tokens, lambda query_start: _draft_rows(drafts, query_start))
        if drafts:
            emitted = self._verify(drafts, slots, result)
            _apply_emitted(self.table, emitted, slots, result.output)
        return result.output

    def _propose(
        self, slots: np.ndarray, n: np.ndarray
    ) -> tuple[dict[int, Draft], np.ndarray, np.ndarray]:
        """({plan index: Draft}, tokens computed per slot, known tokens per slot incl. drafts)."""
        table, drafter = self.table, self.drafter
        if drafter is None:
            return {}, n, table.num_tokens
        decoding = (
            (n > 1)
            & (table.num_tokens[slots] - table.num_computed[slots] == 1)
            & table.speculate[slots]
        )
        if not decoding.any():
            return {}, n, table.num_tokens
        n, num_tokens, drafts = n.copy(), table.num_tokens.copy(), {}
        entries = np.flatnonzero(decoding)
        rooms = np.minimum(n[entries] - 1, self.max_model_len - table.num_tokens[slots[entries]])
        entries, rooms = entries[rooms > 0], rooms[rooms > 0]
        if not entries.size:
            return {}, n, table.num_tokens
        proposals = drafter.propose_batch(table, slots[entries], rooms)
        for b, draft in zip(entries.tolist(), proposals):
            slot = int(slots[b])
            length = int(table.num_tokens[slot])
            d = len(draft.token_ids)
            n[b] = 1 + d
            if d:
                table.tokens[slot, length : length + d] = draft.token_ids
                num_tokens[slot] = length + d
                drafts[b] = draft
        return drafts, n, num_tokens

    def _verify(
        self, drafts: dict[int, Draft], slots: np.ndarray, result: StepRun
    ) -> dict[int, tuple[list[int], int]]:
        """{plan index: (emitted tokens, drafts accepted)} by verify.verify; the target at a
        slot's drafted positions are its draft rows, one past them its ordinary sample row."""
        row_of_slot = {int(slot): row for row, slot in enumerate(result.sample_slots.tolist())}
        emitted, first, output = {}, 0, result.output
        for b, draft in drafts.items():
            slot, d = int(slots[b]), len(draft.token_ids)
            row = row_of_slot[slot]
            target_logits = torch.cat(
                (
                    result.draft_logits[first : first + d],
                    result.sample_logits[row : row + 1],
                )
            )
            first += d
            emitted[b] = _verify_one(self.table, slot, draft, target_logits)
            output.num_draft_tokens += d
            output.num_accepted_draft_tokens += emitted[b][1]
        return emitted


def _draft_rows(drafts: dict[int, Draft], query_start: np.ndarray) -> np.ndarray:
    """The packed rows of every drafted position, in plan order of the drafting slots."""
    rows = [query_start[b] + np.arange(len(draft.token_ids)) for b, draft in drafts.items()]
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)


def _verify_one(
    table: SlotTable, slot: int, draft: Draft, target_logits: torch.Tensor
) -> tuple[list[int], int]:
    d = len(draft.token_ids)
    # The first draft's position: the step has appended its plain sample there (undone by apply).
    length = int(table.num_tokens[slot]) - 1
    if table.temperature[slot] == 0:
        return verify_greedy(target_logits.argmax(dim=-1).cpu().numpy(), draft)
    params = SamplingBatch(
        temperature=np.repeat(table.temperature[slot], d + 1),
        top_k=np.repeat(table.top_k[slot], d + 1),
        top_p=np.repeat(table.top_p[slot], d + 1),
        seed=np.repeat(table.seed[slot], d + 1),
        position=np.arange(length, length + d + 1),
        min_p=np.repeat(table.min_p[slot], d + 1),
    )
    accept_u, draw_u = uniforms(int(table.seed[slot]), length, d + 1)
    return verify(filtered_probs(target_logits, params), draft, accept_u[:d], draw_u)


def _apply_emitted(
    table: SlotTable,
    emitted: dict[int, tuple[list[int], int]],
    slots: np.ndarray,
    output: ComputedStep,
) -> None:
    """Replaces the plain samples of speculating slots by what verification emitted: the
    slot keeps the accepted drafts' KV (computed = known - 1, the decode invariant)."""
    counts = output.num_sampled_tokens
    per_slot = np.split(output.sampled_token_ids, np.cumsum(counts)[:-1]) if counts.size else []
    for b, (tokens, accepted) in emitted.items():
        slot = int(slots[b])
        length = int(table.num_tokens[slot]) - 1  # the step appended one plain sample: undo it
        table.tokens[slot, length : length + len(tokens)] = tokens
        table.num_tokens[slot] = length + len(tokens)
        table.num_computed[slot] = length + accepted
        per_slot[b] = np.asarray(tokens, dtype=np.int64)
        counts[b] = len(tokens)
    output.sampled_token_ids = (
        np.concatenate(per_slot) if len(per_slot) else output.sampled_token_ids
    )
