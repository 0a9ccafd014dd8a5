"""Per-slot sequence state, kept in preallocated host arrays indexed by slot.

    tokens        [max_num_slots, max_model_len + 1] int32   known token ids (prompt + sampled)
    num_tokens    [max_num_slots]                            how many of them are known
    block_table   [max_num_slots, max_blocks_per_seq] int32  append-only, 0 past num_blocks
    num_blocks    [max_num_slots]
    num_computed  [max_num_slots]                            tokens whose KV is in the cache
    sampling      temperature / top_k / top_p / min_p / seed per slot
    processing    per slot LogitsProcessing (penalties, bias, min tokens, logprob counts), with
                  changes_logits / num_logprobs / num_prompt_logprobs mirrored into arrays so
                  that a step finds the few slots that need them without a Python loop
    lora_id       [max_num_slots]                            its LoRA adapter, 0: base model
    active        [max_num_slots] bool

Flat arrays, not objects per sequence, so that a step's inputs are a few vectorized gathers
(no per-token Python work). One extra token column: a sequence that reaches max_model_len still
gets its final sampled token stored.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from model_service.step.plan import NO_PROCESSING, LogitsProcessing


class SlotTable:
    """The model service's state of every slot (the module docstring draws the arrays)."""

    def __init__(self, max_num_slots: int, max_model_len: int, block_size: int) -> None:
        self.max_num_slots = max_num_slots
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.tokens = np.zeros((max_num_slots, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_slots, dtype=np.int64)
        self.block_table = np.zeros((max_num_slots, self.max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_slots, dtype=np.int64)
        self.num_computed = np.zeros(max_num_slots, dtype=np.int64)
        self.temperature = np.ones(max_num_slots, dtype=np.float32)
        self.top_k = np.zeros(max_num_slots, dtype=np.int64)
        self.top_p = np.ones(max_num_slots, dtype=np.float32)
        self.seed = np.zeros(max_num_slots, dtype=np.uint64)
        self.min_p = np.zeros(max_num_slots, dtype=np.float32)
        self.processing: list[LogitsProcessing] = [NO_PROCESSING] * max_num_slots
        self.changes_logits = np.zeros(max_num_slots, dtype=bool)
        self.num_logprobs = np.full(max_num_slots, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(max_num_slots, -1, dtype=np.int64)
        # Where the positions whose next token is a prompt token end: the prompt positions that
        # prompt logprobs score (logits.prompt_logprob_rows) and launches_ahead waits for.
        self.prompt_scored_end = np.zeros(max_num_slots, dtype=np.int64)
        self.speculate = np.zeros(
            max_num_slots, dtype=bool
        )  # may get draft tokens (speculative.py)
        self.lora_id = np.zeros(max_num_slots, dtype=np.int64)  # 0: the base model
        self.active = np.zeros(max_num_slots, dtype=bool)

    def register(
        self,
        slot: int,
        token_ids: np.ndarray,
        num_computed: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int,
        processing: LogitsProcessing | None = None,
        lora_id: int = 0,
    ) -> None:
        n = len(token_ids)
        self.lora_id[slot] = lora_id
        self.tokens[slot, :n] = token_ids
        self.num_tokens[slot] = n
        self.block_table[slot] = 0
        self.num_blocks[slot] = 0
        self.num_computed[slot] = num_computed
        self.temperature[slot], self.top_k[slot], self.top_p[slot], self.seed[slot] = (
            temperature,
            top_k,
            top_p,
            seed,
        )
        processing = processing or NO_PROCESSING
        if processing.num_prompt_tokens == 0:  # registered without one: every known token is prompt
            processing = dataclasses.replace(processing, num_prompt_tokens=n)
        self.processing[slot] = processing
        self.min_p[slot] = processing.min_p
        self.changes_logits[slot] = processing.changes_logits
        self.num_logprobs[slot] = processing.num_logprobs
        self.num_prompt_logprobs[slot] = processing.num_prompt_logprobs
        self.prompt_scored_end[slot] = processing.num_prompt_tokens - 1
        self.active[slot] = True

    def samples_plainly(self, slots: np.ndarray) -> bool:
        """Whether every slot of `slots` draws from its logits, its sampling parameters and its
        position alone: nothing changes its logits (penalties read earlier tokens), no logprobs."""
        return not (
            self.changes_logits[slots]
            | (self.num_logprobs[slots] >= 0)
            | (self.num_prompt_logprobs[slots] >= 0)
        ).any()

    def launches_ahead(self, slots: np.ndarray) -> bool:
        """Whether every slot of `slots` samples from what the device has once the step before
        has run: no prompt position of theirs is still to score for prompt logprobs
        (model_service/step/launch_ahead.py: sampled tokens' logprobs come back with the ids,
        and a penalty counts a token still in flight from the device). A slot that asked for
        them launches again once its prompt is computed."""
        scoring = self.num_prompt_logprobs[slots] >= 0
        return not (scoring & (self.num_computed[slots] < self.prompt_scored_end[slots])).any()

    def samples_greedily(self, slots: np.ndarray) -> bool:
        """samples_plainly, by a plain argmax: no temperature either (cython_ext/decode_step.pyx
        check_decode's rule, for a plan the C checks do not read)."""
        return not (self.temperature[slots] > 0).any() and self.samples_plainly(slots)

    def drop(self, slots: np.ndarray) -> None:
        self.active[slots] = False

    def drop_all(self) -> None:
        self.active[:] = False

    def append_blocks(self, slot: int, block_ids: np.ndarray) -> None:
        start = self.num_blocks[slot]
        self.block_table[slot, start : start + len(block_ids)] = block_ids
        self.num_blocks[slot] = start + len(block_ids)
