"""The draft-model drafter of speculative decoding: a smaller model of the same vocabulary
proposes k tokens per speculating slot by sampling, and hands its distributions to the
verification rule (model_service/speculative/verify.py) with them.

The draft keeps its own paged KV cache with the target's block layout: the same block ids, the
same block tables (SlotTable), so the scheduler's allocation covers both models. Per slot it
remembers how many tokens it has computed; each step it first catches up on what it has not seen
(a new sequence's prompt, or the tokens the last verification emitted) in one batched forward,
which also yields the distribution of the first draft, then runs k - 1 one-token forwards. After
proposing, its computed count is set back to the sequence's known length: whatever verification
keeps, the next catch-up recomputes it (at most k + 1 tokens), so acceptance needs no callback.

Draws are keyed by (seed ^ DRAFT_STREAM, position) like every other draw in the service, so a
seeded request stays reproducible whatever it is batched with.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cython_ext.mapping import StepInputBuilder
from model_service.attention.kv_cache import KVCache, kv_block_bytes
from model_service.loading.loaded import LoadedModel
from model_service.speculative.verify import Draft
from model_service.step.forward import run_forward
from model_service.step.sampler import SamplingBatch, draw, filtered_probs, uniform_for
from model_service.step.slot_table import SlotTable

DRAFT_STREAM = np.uint64(0xA0761D6478BD642F)


def load_draft(config, target: LoadedModel) -> LoadedModel | None:
    """The draft model of `config` (None unless speculative_method is "draft"): loaded before the
    target's KV cache is sized, so its weights are out of the free memory the budget measures and
    its cache is counted in each block's bytes (kv_budget.size_kv_cache)."""
    if config.speculative_method != "draft":
        return None
    from model_service.loading.loader import load_model

    draft_config = dataclasses.replace(
        config,
        model=config.draft_model,
        speculative_method="none",
        draft_model=None,
        served_model_name=None,
        quantization="none",
    )
    loaded = load_model(draft_config)
    if loaded.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"draft_model: vocabulary of {loaded.arch.vocab_size} tokens, the target's has "
            f"{target.arch.vocab_size}"
        )
    return loaded


def _cache_shape(loaded: LoadedModel) -> tuple[int, int, int, torch.dtype]:
    """The draft's own KV cache: (layers, KV heads, head dim, dtype), all of its heads (the draft
    is never tensor-parallel). One owner for the budget (draft_block_bytes) and the cache."""
    arch = loaded.arch
    dtype = next(loaded.model.parameters()).dtype
    return arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, dtype


def draft_block_bytes(loaded: LoadedModel | None, block_size: int) -> int:
    """Bytes one block of the draft's own KV cache takes; 0 without a draft model."""
    if loaded is None:
        return 0
    layers, kv_heads, head_dim, dtype = _cache_shape(loaded)
    return kv_block_bytes(layers, block_size, kv_heads, head_dim, dtype)


class DraftModelDrafter:
    def __init__(
        self,
        loaded: LoadedModel,
        slot_table: SlotTable,
        num_kv_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        """The draft `loaded` beside a target whose slot table (tokens and block tables) it
        reads, with a KV cache of the target's block count and size."""
        self.loaded = loaded
        self.model = self.loaded.model
        self.device = device
        self.slot_table = slot_table
        layers, kv_heads, head_dim, dtype = _cache_shape(loaded)
        self.kv_cache = KVCache(
            layers, num_kv_blocks, block_size, kv_heads, head_dim, dtype, self.device
        )
        self.block_size = block_size
        self.num_computed = np.zeros(slot_table.max_num_slots, dtype=np.int64)
        self.inputs = StepInputBuilder(
            max(self.loaded.max_model_len, slot_table.max_num_slots),
            slot_table.max_num_slots,
            slot_table.max_blocks_per_seq,
            self.block_size,
        )

    def on_register(self, slot: int) -> None:
        """A new sequence in `slot`: the draft has computed none of it (shared prefix blocks are
        recomputed into the draft's cache; same tokens, same positions, same values)."""
        self.num_computed[slot] = 0

    def _forward(self, slots: np.ndarray, n: np.ndarray, num_tokens: np.ndarray) -> torch.Tensor:
        """One draft forward computing n[i] tokens of slots[i]; logits of each slot's last row."""
        c = self.slot_table
        x = self.inputs.build(c.tokens, c.block_table, self.num_computed, num_tokens, slots, n)
        logits = run_forward(
            self.model, self.kv_cache, x, n, x.logits_indices, self.block_size, self.device
        )
        self.num_computed[slots] += n
        return logits.float()

    def _next(
        self, logits: torch.Tensor, slots: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, torch.Tensor]:
        """Draft tokens at `positions` and the distributions they were drawn from (normalized)."""
        c = self.slot_table
        params = SamplingBatch(
            temperature=c.temperature[slots],
            top_k=c.top_k[slots],
            top_p=c.top_p[slots],
            seed=c.seed[slots],
            position=positions,
            min_p=c.min_p[slots],
        )
        weights = filtered_probs(logits, params)
        greedy = c.temperature[slots] == 0
        tokens = draw(weights, uniform_for(c.seed[slots] ^ DRAFT_STREAM, positions)).cpu().numpy()
        tokens = np.where(greedy, logits.argmax(dim=-1).cpu().numpy(), tokens)
        return tokens.astype(np.int64), weights / weights.sum(dim=-1, keepdim=True)

    def propose_batch(self, slot_table, slots: np.ndarray, rooms: np.ndarray) -> list[Draft]:
        """Up to rooms[i] drafts for each of slots (decoding: every known token but the last is
        computed by the target). Writes the drafts after the known tokens in SlotTable.tokens."""
        c = self.slot_table
        lengths = c.num_tokens[slots].copy()
        num_tokens = c.num_tokens.copy()
        # Catch up on everything the draft has not computed, up to the last known token.
        logits = self._forward(slots, lengths - self.num_computed[slots], num_tokens)
        proposals: list[list[int]] = [[] for _ in slots]
        probs: list[list[torch.Tensor]] = [[] for _ in slots]
        live = np.arange(len(slots))
        for i in range(int(rooms.max())):
            positions = lengths[live] + i
            tokens, dists = self._next(logits, slots[live], positions)
            for j, row in enumerate(live.tolist()):
                proposals[row].append(int(tokens[j]))
                probs[row].append(dists[j])
                c.tokens[slots[row], positions[j]] = tokens[j]
            live = live[rooms[live] > i + 1]
            if not live.size:
                break
            # Feed each live slot its newest draft.
            num_tokens[slots[live]] = lengths[live] + i + 1
            logits = self._forward(slots[live], np.ones(live.size, dtype=np.int64), num_tokens)
        self.num_computed[slots] = lengths  # see the module docstring
        drafts = []
        for row, slot in enumerate(slots.tolist()):
            greedy = c.temperature[slot] == 0
            drafts.append(
                Draft(
                    np.asarray(proposals[row], dtype=np.int64),
                    None if greedy else torch.stack(probs[row]),
                )
            )
        return drafts
