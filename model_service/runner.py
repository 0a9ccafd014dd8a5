"""The model runner: applies one PlanArrays to the slot state, runs one forward, samples.

Order of application (engine.proto, BatchPlan):
  1. drop finished / preempted / aborted slots;
  2. register new sequences (num_computed_tokens = tokens already in the KV cache);
  3. append new block ids to the scheduled slots' block tables;
  4. run block copies;
  5. one forward over the scheduled slots, then sample for every slot whose computed tokens reach
     its known tokens; the sampled token is appended to that slot and computed advances.
The whole plan is checked against the state before anything changes, so a bad plan leaves the
state as it was.

Packed inputs of one step (B scheduled slots, n[b] tokens each, T = sum(n)):

    row            0 .. n[0]-1        | n[0] .. n[0]+n[1]-1 | ...
    slot           slots[0]           | slots[1]            | ...
    position       c[0] .. c[0]+n[0]-1| c[1] .. c[1]+n[1]-1 | ...   (c: computed before the step)
    input id       tokens[slot, position]
    KV write slot  block_table[slot, position // bs] * bs + position % bs

cython_ext.mapping.StepInputBuilder fills these rows (and the per-slot query_start, context_lens,
needs_sample, logits rows, read block tables) into preallocated buffers in one C loop; its oracle,
the numpy original, is in tests/model_service/test_ms_mapping.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import structlog
import torch

from cython_ext.mapping import StepInputBuilder
from model_service import threads
from model_service.attention import ATTENTION_ISA, build_attention_metadata
from model_service.batch import ComputedStep, PlanArrays, PlanError, PlanLimits
from model_service.config import ModelServiceConfig
from model_service.gemm import PackedLinear
from model_service.kv_cache import (
    KVCache,
    agree_on_num_blocks,
    kv_block_bytes,
    kv_cache_budget_bytes,
)
from model_service.layer_ops import LAYER_OPS_ISA
from model_service.loaded import LoadedModel
from model_service.logits import apply_masks, apply_processing, gather_logprobs, prompt_logprob_rows
from model_service.sampler import SamplingBatch, filtered_probs, sample
from model_service.slot_table import SlotTable
from model_service.speculative import NgramDrafter, uniforms, verify, verify_greedy

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class DescribedFacts:
    """What this model service describes about itself in Describe, as plain values (the
    scheduler's reading of the reply is scheduler_service/engine/client.py EngineFacts)."""

    model_name: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_slots: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    tokenizer_json: str
    chat_template: str
    special_tokens: dict[str, str]
    chunked_prefill: bool = True
    block_copy: bool = True
    num_swap_blocks: int = 0
    num_speculative_tokens: int = 0  # > 0: speculation on, this many drafts per decode at most
    compute: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # threads and kernel paths (threads.py)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: ModelServiceConfig) -> None:
        config.validate()
        self.loaded = loaded
        self.config = config
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        arch = loaded.arch
        self.block_size = config.block_size
        if config.num_kv_blocks is not None or loaded.num_kv_blocks is not None:
            num_blocks = (
                config.num_kv_blocks if config.num_kv_blocks is not None else loaded.num_kv_blocks
            )
        else:
            per_block = kv_block_bytes(
                arch.num_hidden_layers,
                self.block_size,
                loaded.num_kv_heads_per_rank,
                arch.head_dim,
                self.dtype,
            )
            budget = kv_cache_budget_bytes(
                config.kv_cache_memory_bytes,
                config.kv_cache_memory_fraction,
                self.device,
                loaded.tensor_parallel_size,
            )
            num_blocks = budget // per_block
            if config.kv_cache_memory_fraction is not None and loaded.tensor_parallel_size > 1:
                num_blocks = agree_on_num_blocks(
                    num_blocks, self.device
                )  # free memory differs per rank
            if num_blocks < 2:
                field = (
                    "kv_cache_memory_bytes"
                    if config.kv_cache_memory_fraction is None
                    else "kv_cache_memory_fraction"
                )
                raise ValueError(
                    f"{field}: a budget of {budget} bytes holds {num_blocks} blocks of {per_block} "
                    "bytes; need >= 2"
                )
        # Under tensor parallelism each rank caches only its own KV heads.
        self.kv_cache = KVCache(
            arch.num_hidden_layers,
            num_blocks,
            self.block_size,
            loaded.num_kv_heads_per_rank,
            arch.head_dim,
            self.dtype,
            self.device,
        )
        self.kv_cache.allocate_swap(config.swap_space_bytes // self.kv_cache.block_bytes)
        self.slot_table = SlotTable(config.max_num_slots, loaded.max_model_len, self.block_size)
        # Row capacity is a first guess (no token budget is configured here); the builder grows it.
        self.inputs = StepInputBuilder(
            max(loaded.max_model_len, config.max_num_slots),
            config.max_num_slots,
            self.slot_table.max_blocks_per_seq,
            self.block_size,
        )
        self.limits = PlanLimits(
            vocab_size=arch.vocab_size,
            num_kv_blocks=num_blocks,
            max_num_slots=config.max_num_slots,
            max_model_len=loaded.max_model_len,
            num_swap_blocks=self.kv_cache.num_swap_blocks,
        )
        # Speculative decoding: the drafter proposes, _verify_drafts decides
        # (model_service/speculative.py).
        self.drafter = None
        self.num_speculative_tokens = 0
        if config.speculative_method == "ngram":
            self.drafter = NgramDrafter(max_n=config.ngram_max)
        elif config.speculative_method == "draft":
            from model_service.draft_model import DraftModelDrafter

            self.drafter = DraftModelDrafter(config, self)
        if self.drafter is not None:
            self.num_speculative_tokens = config.num_speculative_tokens
        # execute() runs in a worker thread; reset() may come from the event loop when a stream
        # ends.
        self._lock = threading.Lock()
        on_cpu = self.device.type == "cpu"
        self.compute = {
            **threads.settings(),
            "attention": ATTENTION_ISA if on_cpu else "torch",
            "layer_ops": LAYER_OPS_ISA if on_cpu else "torch",
            "gemm": next(
                (m.isa for m in loaded.model.modules() if isinstance(m, PackedLinear)), "torch"
            ),
        }
        log.info(
            "runner_ready",
            model=loaded.name,
            device=str(self.device),
            dtype=config.resolved_dtype(),
            num_kv_blocks=num_blocks,
            **self.compute,
        )

    def describe_facts(self) -> DescribedFacts:
        lm = self.loaded
        return DescribedFacts(
            model_name=lm.name,
            architecture="llama",
            dtype=self.config.resolved_dtype(),
            device=str(self.device)
            if self.device.index is not None or self.device.type == "cpu"
            else f"{self.device.type}:0",
            vocab_size=lm.arch.vocab_size,
            max_model_len=lm.max_model_len,
            block_size=self.block_size,
            num_kv_blocks=self.limits.num_kv_blocks,
            max_num_slots=self.config.max_num_slots,
            eos_token_ids=list(lm.eos_token_ids),
            bos_token_id=lm.bos_token_id,
            tokenizer_json=lm.tokenizer_json,
            chat_template=lm.chat_template,
            special_tokens=dict(lm.special_tokens),
            num_swap_blocks=self.limits.num_swap_blocks,
            num_speculative_tokens=self.num_speculative_tokens,
            compute=self.compute,
        )

    def reset(self) -> None:
        """Drop every slot (the Execute stream ended)."""
        with self._lock:
            self.slot_table.drop_all()

    # -- plan checks against the slot state -------------------------------------------------

    def _check(self, plan: PlanArrays) -> None:
        c = self.slot_table
        active = c.active.copy()
        for name in ("finished_slots", "preempted_slots", "aborted_slots"):
            for slot in getattr(plan, name):
                if not active[slot]:
                    raise PlanError(name, f"slot {slot} is not registered")
                active[slot] = False
        num_tokens, num_computed, num_blocks = (
            c.num_tokens.copy(),
            c.num_computed.copy(),
            c.num_blocks.copy(),
        )
        speculate = c.speculate.copy()
        for i, seq in enumerate(plan.new_sequences):
            if active[seq.slot]:
                raise PlanError(f"new_sequences[{i}].slot", f"slot {seq.slot} is occupied")
            active[seq.slot] = True
            num_tokens[seq.slot], num_computed[seq.slot], num_blocks[seq.slot] = (
                len(seq.token_ids),
                seq.num_computed_tokens,
                0,
            )
            speculate[seq.slot] = seq.speculate
        slots = plan.slots
        if slots.size == 0:
            return
        if not active[slots].all():
            raise PlanError("slots", f"slot {slots[~active[slots]][0]} is not registered")
        end = num_computed[slots] + plan.num_scheduled_tokens
        # A speculating decode may be granted up to k draft tokens past what is known.
        lookahead = np.where(
            (num_tokens[slots] - num_computed[slots] == 1) & speculate[slots],
            self.num_speculative_tokens,
            0,
        )
        over = end > num_tokens[slots] + lookahead
        if over.any():
            i = int(np.argmax(over))
            raise PlanError(
                "num_scheduled_tokens",
                f"slot {slots[i]}: computed {num_computed[slots[i]]} + scheduled "
                f"{plan.num_scheduled_tokens[i]} exceeds its {num_tokens[slots[i]]} known tokens",
            )
        if plan.masked_slots.size:
            missing = ~np.isin(plan.masked_slots, slots[end >= num_tokens[slots]])
            if missing.any():
                raise PlanError(
                    "masked_slots",
                    f"slot {plan.masked_slots[int(np.argmax(missing))]} does not sample this step",
                )
        if end.max() > self.limits.max_model_len:
            raise PlanError(
                "num_scheduled_tokens",
                f"{end.max()} tokens exceed max_model_len {self.limits.max_model_len}",
            )
        blocks_after = num_blocks[slots] + plan.num_new_blocks
        short = blocks_after * self.block_size < end
        if short.any():
            i = int(np.argmax(short))
            raise PlanError(
                "num_new_blocks",
                f"slot {slots[i]}: {blocks_after[i]} blocks cannot hold {end[i]} tokens",
            )
        if blocks_after.max() > c.max_blocks_per_seq:
            raise PlanError(
                "num_new_blocks",
                f"{blocks_after.max()} blocks exceed {c.max_blocks_per_seq} per sequence",
            )

    # -- one step ---------------------------------------------------------------------------

    def execute(self, plan: PlanArrays) -> ComputedStep:
        with self._lock, torch.inference_mode():
            return self._execute(plan)

    def _apply_diff(self, plan: PlanArrays) -> None:
        c = self.slot_table
        for dropped in (plan.finished_slots, plan.preempted_slots, plan.aborted_slots):
            c.drop(dropped)
        for seq in plan.new_sequences:
            c.register(
                seq.slot,
                seq.token_ids,
                seq.num_computed_tokens,
                seq.temperature,
                seq.top_k,
                seq.top_p,
                seq.seed,
                seq.processing,
            )
            c.speculate[seq.slot] = seq.speculate and self.drafter is not None
            if self.drafter is not None:
                self.drafter.on_register(seq.slot)
        if plan.new_block_ids.size:
            # Each scheduled slot's new ids go right after its current blocks.
            rows = np.repeat(plan.slots, plan.num_new_blocks)
            first = np.concatenate(([0], np.cumsum(plan.num_new_blocks)[:-1]))
            cols = np.repeat(c.num_blocks[plan.slots] - first, plan.num_new_blocks) + np.arange(
                plan.new_block_ids.size
            )
            c.block_table[rows, cols] = plan.new_block_ids
            c.num_blocks[plan.slots] += plan.num_new_blocks
        # Reads of freed blocks before writes of fresh ones (order in model_service/kv_cache.py).
        if plan.swap_out_src.size:
            self.kv_cache.swap_out(
                self._dev(plan.swap_out_src), torch.from_numpy(plan.swap_out_dst)
            )
        if plan.copy_src.size:
            self.kv_cache.copy_blocks(self._dev(plan.copy_src), self._dev(plan.copy_dst))
        if plan.swap_in_src.size:
            self.kv_cache.swap_in(torch.from_numpy(plan.swap_in_src), self._dev(plan.swap_in_dst))

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(
            self.device, non_blocking=True
        )

    def _execute(self, plan: PlanArrays) -> ComputedStep:
        self._check(plan)
        self._apply_diff(plan)
        c, bs, slots, n = self.slot_table, self.block_size, plan.slots, plan.num_scheduled_tokens
        if slots.size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return ComputedStep(plan.step_id, empty, empty, 0, 0)

        # Speculation: decoding slots granted 1 + k tokens get their drafts appended for this step;
        # n becomes what is computed (1 + drafts), the drafts count as known tokens for the build.
        drafts, n, num_tokens = self._propose_drafts(slots, n)
        x = self.inputs.build(
            c.tokens, c.block_table, c.num_computed, num_tokens, slots, n
        )  # views, valid this step

        start = time.perf_counter_ns()
        meta = build_attention_metadata(
            self._dev(x.slot_mapping),
            self._dev(x.query_start),
            self._dev(n),
            self._dev(x.context_lens),
            self._dev(x.block_tables),
            bs,
            x.max_query_len,
            x.max_context_len,
        )
        # Prompt logprobs (rare) need the logits of prompt rows too: they ride after the sample
        # rows.
        prompt_rows, prompt_targets, prompt_counts = prompt_logprob_rows(slots, n, x.query_start, c)
        # Verification needs the target at every drafted position: those rows follow the sample
        # rows.
        draft_rows = [
            x.query_start[b] + np.arange(len(draft.token_ids)) for b, draft in drafts.items()
        ]
        draft_rows = (
            np.concatenate(draft_rows).astype(np.int64)
            if draft_rows
            else np.zeros(0, dtype=np.int64)
        )
        logits_indices = (
            np.concatenate((x.logits_indices, draft_rows, prompt_rows))
            if draft_rows.size or prompt_rows.size
            else x.logits_indices
        )
        logits = self.model(
            self._dev(x.input_ids),
            self._dev(x.positions),
            meta,
            self.kv_cache,
            self._dev(logits_indices),
        )
        self._sync()
        forward_ns = time.perf_counter_ns() - start

        start = time.perf_counter_ns()
        sample_slots = x.sample_slots
        output = ComputedStep(
            plan.step_id, x.needs_sample.copy(), np.zeros(0, dtype=np.int64), forward_ns, 0
        )
        if sample_slots.size:
            output.sampled_token_ids = self._sample(
                logits[: sample_slots.size], sample_slots, plan, output
            )
        if prompt_rows.size:
            first = sample_slots.size + draft_rows.size
            output.prompt_logprobs, output.prompt_logprob_token_ids = gather_logprobs(
                logits[first:], prompt_targets, prompt_counts
            )
        emitted = {}
        if drafts:
            emitted = self._verify_drafts(
                drafts,
                slots,
                x,
                logits[sample_slots.size : sample_slots.size + draft_rows.size],
                logits[: sample_slots.size],
                output,
            )
        output.sample_ns = time.perf_counter_ns() - start

        sampled = output.sampled_token_ids
        c.num_computed[slots] = x.context_lens
        c.tokens[sample_slots, c.num_tokens[sample_slots]] = sampled
        c.num_tokens[sample_slots] += 1
        if emitted:
            self._apply_emitted(emitted, slots, output)
        return output

    # -- speculative decoding -----------------------------------------------------------------

    def _propose_drafts(
        self, slots: np.ndarray, n: np.ndarray
    ) -> tuple[dict, np.ndarray, np.ndarray]:
        """({plan index: Draft}, tokens computed per slot, known tokens per slot incl. drafts)."""
        c = self.slot_table
        if self.drafter is None:
            return {}, n, c.num_tokens
        decoding = (n > 1) & (c.num_tokens[slots] - c.num_computed[slots] == 1) & c.speculate[slots]
        if not decoding.any():
            return {}, n, c.num_tokens
        n, num_tokens, drafts = n.copy(), c.num_tokens.copy(), {}
        entries = np.flatnonzero(decoding)
        rooms = np.minimum(n[entries] - 1, self.loaded.max_model_len - c.num_tokens[slots[entries]])
        entries, rooms = entries[rooms > 0], rooms[rooms > 0]
        if not entries.size:
            return {}, n, c.num_tokens
        proposals = self.drafter.propose_batch(c, slots[entries], rooms)
        for b, draft in zip(entries.tolist(), proposals):
            slot, length = int(slots[b]), int(c.num_tokens[slots[b]])
            d = len(draft.token_ids)
            n[b] = 1 + d
            if d:
                c.tokens[slot, length : length + d] = draft.token_ids
                num_tokens[slot] = length + d
                drafts[b] = draft
        return drafts, n, num_tokens

    def _verify_drafts(
        self,
        drafts: dict,
        slots: np.ndarray,
        x,
        draft_logits: torch.Tensor,
        sample_logits: torch.Tensor,
        output: ComputedStep,
    ) -> dict:
        """{plan index: (emitted tokens, drafts accepted)} by speculative.verify; the target at a
        slot's drafted positions are its draft rows, one past them its ordinary sample row."""
        c = self.slot_table
        row_of_slot = {int(slot): row for row, slot in enumerate(x.sample_slots.tolist())}
        emitted, first = {}, 0
        for b, draft in drafts.items():
            slot, d = int(slots[b]), len(draft.token_ids)
            target_logits = torch.cat(
                (
                    draft_logits[first : first + d],
                    sample_logits[row_of_slot[slot] : row_of_slot[slot] + 1],
                )
            )
            first += d
            length = int(c.num_tokens[slot])  # the first draft's position
            if c.temperature[slot] == 0:
                result = verify_greedy(target_logits.argmax(dim=-1).cpu().numpy(), draft)
            else:
                params = SamplingBatch(
                    temperature=np.repeat(c.temperature[slot], d + 1),
                    top_k=np.repeat(c.top_k[slot], d + 1),
                    top_p=np.repeat(c.top_p[slot], d + 1),
                    seed=np.repeat(c.seed[slot], d + 1),
                    position=np.arange(length, length + d + 1),
                    min_p=np.repeat(c.min_p[slot], d + 1),
                )
                accept_u, draw_u = uniforms(int(c.seed[slot]), length, d + 1)
                result = verify(filtered_probs(target_logits, params), draft, accept_u[:d], draw_u)
            emitted[b] = result
            output.num_draft_tokens += d
            output.num_accepted_draft_tokens += result[1]
        return emitted

    def _apply_emitted(self, emitted: dict, slots: np.ndarray, output: ComputedStep) -> None:
        """Replaces the plain samples of speculating slots by what verification emitted: the
        slot keeps the accepted drafts' KV (computed = known - 1, the decode invariant)."""
        c = self.slot_table
        counts = output.num_sampled_tokens
        per_slot = np.split(output.sampled_token_ids, np.cumsum(counts)[:-1]) if counts.size else []
        for b, (tokens, accepted) in emitted.items():
            slot = int(slots[b])
            length = int(c.num_tokens[slot]) - 1  # the step appended one plain sample: undo it
            c.tokens[slot, length : length + len(tokens)] = tokens
            c.num_tokens[slot] = length + len(tokens)
            c.num_computed[slot] = length + accepted
            per_slot[b] = np.asarray(tokens, dtype=np.int64)
            counts[b] = len(tokens)
        output.sampled_token_ids = (
            np.concatenate(per_slot) if len(per_slot) else output.sampled_token_ids
        )

    def _sample(
        self, logits: torch.Tensor, sample_slots: np.ndarray, plan: PlanArrays, output: ComputedStep
    ) -> np.ndarray:
        """Logits processing, sampling and logprobs for the sample rows; returns the token ids
        (and fills output's logprob arrays)."""
        c = self.slot_table
        raw = logits
        processed = np.flatnonzero(c.changes_logits[sample_slots])
        if processed.size or plan.masked_slots.size:
            logits = logits.clone()
            if processed.size:
                apply_processing(logits, processed, sample_slots[processed], c)
            if plan.masked_slots.size:
                row_of_slot = {slot: row for row, slot in enumerate(sample_slots.tolist())}
                rows = np.array(
                    [row_of_slot[slot] for slot in plan.masked_slots.tolist()], dtype=np.int64
                )  # _check: all sample
                apply_masks(logits, rows, plan.allowed_token_bitmask, raw)
        params = SamplingBatch(
            temperature=c.temperature[sample_slots],
            top_k=c.top_k[sample_slots],
            top_p=c.top_p[sample_slots],
            seed=c.seed[sample_slots],
            position=c.num_tokens[sample_slots],
            min_p=c.min_p[sample_slots],
        )
        sampled = sample(logits, params).cpu().numpy().astype(np.int64)
        logprob_rows = np.flatnonzero(c.num_logprobs[sample_slots] >= 0)
        if logprob_rows.size:
            output.logprobs, output.logprob_token_ids = gather_logprobs(
                raw[torch.from_numpy(logprob_rows).to(raw.device)],
                sampled[logprob_rows],
                c.num_logprobs[sample_slots[logprob_rows]],
            )
        return sampled

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
