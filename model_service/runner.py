"""The model runner: applies one PlanArrays to the slot state, runs one forward, samples.

Order of application (engine.proto, BatchPlan):
  1. drop finished / preempted / aborted slots;
  2. register new sequences (num_computed_tokens = tokens already in the KV cache);
  3. append new block ids to the scheduled slots' block tables;
  4. run block copies;
  5. one forward over the scheduled slots, then sample for every slot whose computed tokens reach
     its known tokens; the sampled token is appended to that slot and computed advances.
The whole plan is checked against the state before anything changes (slot_checks.py), so a bad
plan leaves the state as it was. Speculation is one stage around the step
(speculative/stage.py: propose, run, verify, apply); sampling is step/sample_step.py.

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

import threading
from typing import Callable

import numpy as np
import structlog
import torch

from cython_ext import decode_step
from cython_ext.mapping import StepInputBuilder, StepInputs
from model_service.attention.kv_cache import KVCache
from model_service.config import ModelServiceConfig
from model_service.described import DescribedFacts
from model_service.loading.loaded import LoadedModel
from model_service.lora import grouping
from model_service.lora.peft_folder import Adapter, AdapterError
from model_service.lora.stacked import LoadedStack
from model_service.lora.store import AdapterStore
from model_service.lora.triton_stack import TritonView
from model_service.speculative.stage import Drafter, SpeculationStage, StepRun
from model_service.step import decode_fast, launch_ahead, step_shape
from model_service.step.cuda_graphs import StepGraphs
from model_service.step.forward import StepClock, run_forward
from model_service.step.launch_ahead import Launched
from model_service.step.logits import LogitsRows, gather_logprobs, logits_rows
from model_service.step.plan import ComputedStep, PlanArrays, PlanLimits
from model_service.step.sample_step import sample_rows
from model_service.step.sampler import argmax_rows, on_device
from model_service.step.slot_checks import check_plan
from model_service.step.slot_table import SlotTable

log = structlog.get_logger(__name__)


class ModelRunner:
    """Runs one plan at a time over what the start-up (model_service/start.py) built and hands
    it: the model, its KV cache, the slot table, the drafter and the step graphs."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: ModelServiceConfig,
        kv_cache: KVCache,
        slot_table: SlotTable,
        drafter: Drafter | None = None,
        graphs: StepGraphs | None = None,
        compute: dict[str, str] | None = None,
        adapters: AdapterStore | None = None,
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        # execute() runs in a worker thread; reset() may come from the event loop when a stream
        # ends.
        self._lock = threading.Lock()
        self.kv_cache = kv_cache
        self.slot_table = slot_table
        # Row capacity: the step the device's shape allows (a larger plan grows the builder).
        self.inputs = StepInputBuilder(
            step_shape.for_device(config, self.device).token_budget,
            config.max_num_slots,
            slot_table.max_blocks_per_seq,
            self.block_size,
        )
        self.limits = PlanLimits(
            vocab_size=loaded.arch.vocab_size,
            num_kv_blocks=kv_cache.num_blocks,
            max_num_slots=config.max_num_slots,
            max_model_len=loaded.max_model_len,
            num_swap_blocks=kv_cache.num_swap_blocks,
        )
        self.speculation = SpeculationStage(drafter, slot_table, loaded.max_model_len)
        self.num_speculative_tokens = 0 if drafter is None else config.num_speculative_tokens
        self.graphs = graphs
        self.compute = compute or {}
        # --enable-lora: the loaded adapters (LoadAdapter adds them from another thread), and
        # the current step's view of them (taken once, before its plan is checked).
        self.adapters = adapters
        self._step_adapters: dict[int, Adapter] = {}
        self._step_stack: LoadedStack | TritonView | None = None
        # Plain plans (PlanArrays.plain) checked and applied by step/decode_fast.py; its checks
        # know neither drafts nor adapters. False: every plan takes the general path.
        self.fast_path = drafter is None and adapters is None
        # Steps queued on the device behind the one in flight (step/launch_ahead.py).
        self.ahead, self.compute["launch_ahead"] = launch_ahead.for_runner(
            config.launch_ahead, graphs, self, drafter is not None
        )

    def describe_facts(self) -> DescribedFacts:
        lm = self.loaded
        shape = step_shape.for_device(self.config, self.device)
        return DescribedFacts(
            model_name=lm.name,
            architecture=lm.arch.architecture,
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
            step_token_budget=shape.token_budget,
            step_max_seqs=shape.max_seqs,
            compute=self.compute,
            lora=self.adapters,
        )

    def reset(self) -> None:
        """Drop every slot (the Execute stream ended)."""
        with self._lock:
            self.slot_table.drop_all()

    # -- one step ---------------------------------------------------------------------------

    def execute(self, plan: PlanArrays) -> ComputedStep:
        with self._lock, torch.inference_mode():
            return self._execute(plan)

    def step_ahead(
        self, plan: PlanArrays, prior: Launched | None
    ) -> tuple[list[ComputedStep], Launched | None]:
        """`plan` launched behind `prior` where step/launch_ahead.py allows, else run after it:
        (the steps finished, in order; the step in flight). A PlanError changes nothing."""
        with self._lock, torch.inference_mode():
            assert self.ahead is not None
            c, fast = self.slot_table, plan.plain and self.fast_path
            if fast:
                greedy = decode_fast.check_and_append(plan, c, self.limits, self.block_size)
            else:
                self._check(plan)
                if prior is not None:  # a dropped slot's token in flight stays out of the table
                    prior.forget(plan.finished_slots, plan.preempted_slots, plan.aborted_slots)
                self._apply_diff(plan)  # copies and swaps queued behind the step in flight
                greedy = c.samples_greedily(plan.slots) and not plan.masked_slots.size
            launched = None
            if plan.slots.size and (greedy or c.launches_ahead(plan.slots)):
                lora = self._step_lora(plan.slots, plan.num_scheduled_tokens)
                launched = self.ahead.launch(plan, prior, greedy, lora)
            done = self.ahead.finished(prior)
            if launched is not None:
                return done, launched
            ran = self._run_plain(plan, greedy) if fast else self._run_applied(plan)
            return [*done, ran], None

    def finish(self, step: Launched) -> ComputedStep:
        """The launched step's result, once its ids are on the host."""
        with self._lock:
            assert self.ahead is not None
            return self.ahead.finish(step)

    def load_adapter(self, lora_id: int, name: str, path: str) -> Adapter:
        """LoadAdapter, on the caller's thread (never under the step's lock: steps go on)."""
        if self.adapters is None:
            raise _lora_off()
        return self.adapters.load(lora_id, name, path)

    def evict_adapter(self, lora_id: int) -> None:
        """EvictAdapter; a step that already took its view of the adapters keeps it."""
        if self.adapters is None:
            raise _lora_off()
        self.adapters.evict(lora_id)

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
                seq.lora_id,
            )
            self.speculation.register(seq.slot, seq.speculate)
        if plan.new_block_ids.size:
            # Each scheduled slot's new ids go right after its current blocks.
            rows = np.repeat(plan.slots, plan.num_new_blocks)
            first = np.concatenate(([0], np.cumsum(plan.num_new_blocks)[:-1]))
            cols = np.repeat(c.num_blocks[plan.slots] - first, plan.num_new_blocks) + np.arange(
                plan.new_block_ids.size
            )
            c.block_table[rows, cols] = plan.new_block_ids
            c.num_blocks[plan.slots] += plan.num_new_blocks
        # Reads of freed blocks before writes of fresh ones (order in attention/kv_cache.py).
        if plan.swap_out_src.size:
            self.kv_cache.swap_out(
                self._dev(plan.swap_out_src), torch.from_numpy(plan.swap_out_dst)
            )
        if plan.copy_src.size:
            self.kv_cache.copy_blocks(self._dev(plan.copy_src), self._dev(plan.copy_dst))
        if plan.swap_in_src.size:
            self.kv_cache.swap_in(torch.from_numpy(plan.swap_in_src), self._dev(plan.swap_in_dst))

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return on_device(self.device, array)  # pinned: a step launched ahead copies blocks

    def _execute(self, plan: PlanArrays) -> ComputedStep:
        if plan.plain and self.fast_path:
            greedy = decode_fast.check_and_append(
                plan, self.slot_table, self.limits, self.block_size
            )
            return self._run_plain(plan, greedy)
        self._check(plan)
        self._apply_diff(plan)
        return self._run_applied(plan)

    def _check(self, plan: PlanArrays) -> None:
        """The plan against the slot table and this step's view of the adapters (taken here)."""
        check_plan(plan, self.slot_table, self.limits, self.block_size, self.num_speculative_tokens)
        store = self.adapters
        self._step_adapters, self._step_stack = (
            store.step_view() if store is not None else ({}, None)
        )
        grouping.check_plan_adapters(
            plan,
            self.slot_table.lora_id,
            self._step_adapters if store is not None else None,
            store.max_loras if store is not None else 0,
        )

    def _run_plain(self, plan: PlanArrays, greedy: bool) -> ComputedStep:
        """A plain plan's step, its blocks appended (decode_fast.check_and_append)."""
        c = self.slot_table
        return self._step(plan, plan.num_scheduled_tokens, c.num_tokens, _no_drafts, greedy).output

    def _run_applied(self, plan: PlanArrays) -> ComputedStep:
        """A checked plan's step, its diff applied: the speculation stage around the forward."""
        if plan.slots.size == 0:
            return ComputedStep(plan.step_id, _NONE, _NONE, 0, 0)
        return self.speculation.around(
            plan.slots,
            plan.num_scheduled_tokens,
            lambda n, num_tokens, draft_rows: self._step(plan, n, num_tokens, draft_rows),
        )

    def _step(
        self,
        plan: PlanArrays,
        n: np.ndarray,
        num_tokens: np.ndarray,
        draft_rows: Callable[[np.ndarray], np.ndarray],
        greedy: bool = False,
    ) -> StepRun:
        """Computes n[b] tokens of each scheduled slot (num_tokens: the known tokens per slot,
        drafts included), samples, and advances the slot table by the plain samples. `greedy`:
        every slot samples by a plain argmax (decode_fast.check_and_append said so)."""
        c, slots = self.slot_table, plan.slots
        x = self.inputs.build(
            c.tokens, c.block_table, c.num_computed, num_tokens, slots, n
        )  # views, valid this step
        if greedy:  # no prompt logprobs, no drafts: the sample rows alone
            rows = LogitsRows(x.sample_slots.size, _NONE, _NONE, _NONE, _NONE, x.logits_indices)
        else:
            rows = logits_rows(x, slots, n, draft_rows(x.query_start), c)

        clock = StepClock(self.device)
        logits = self._forward(x, n, rows.indices, self._step_lora(slots, n))
        clock.forward_launched()
        output = ComputedStep(
            plan.step_id, x.needs_sample.copy(), np.zeros(0, dtype=np.int64), 0, 0
        )
        if not greedy:
            self._sample(logits, x, plan, rows, output)
        elif rows.num_sample:  # what sample_rows returns for such rows
            output.sampled_token_ids = argmax_rows(logits).cpu().numpy().astype(np.int64)
        output.forward_ns, output.sample_ns = clock.finish()

        # computed advances; each sample slot's token appended (one C loop, no array per field)
        decode_step.advance(c, slots, x.context_lens, x.sample_slots, output.sampled_token_ids)
        num_sample, num_draft = rows.num_sample, rows.draft.size
        return StepRun(
            output,
            x.sample_slots,
            logits[:num_sample],
            logits[num_sample : num_sample + num_draft],
        )

    def _step_lora(self, slots: np.ndarray, n: np.ndarray):
        """Each row's slot's adapter (the step's view, from _check); None: base rows, or no LoRA."""
        if self.adapters is None:
            return None
        row_lora = np.repeat(self.slot_table.lora_id[slots], n)
        return grouping.group_rows(row_lora, self._step_adapters, self.device, self._step_stack)

    def _forward(
        self,
        x: StepInputs,
        n: np.ndarray,
        logits_indices: np.ndarray,
        lora: grouping.LoraStep | grouping.TritonLoraStep | None = None,
    ) -> torch.Tensor:
        # A step with adapter rows replays only where the graphs hold the LoRA kernels.
        if self.graphs and (logits := self.graphs.run(x, n, logits_indices, lora)) is not None:
            return logits
        return run_forward(
            self.model, self.kv_cache, x, n, logits_indices, self.block_size, self.device, lora
        )

    def _sample(
        self,
        logits: torch.Tensor,
        x: StepInputs,
        plan: PlanArrays,
        rows: LogitsRows,
        output: ComputedStep,
    ) -> None:
        """Fills output's tokens and logprobs from the logits rows."""
        num_sample, num_draft = rows.num_sample, rows.draft.size
        if num_sample:
            output.sampled_token_ids = sample_rows(
                logits[:num_sample], x.sample_slots, plan, self.slot_table, output
            )
        if rows.prompt.size:
            output.prompt_logprobs, output.prompt_logprob_token_ids = gather_logprobs(
                logits[num_sample + num_draft :], rows.prompt_targets, rows.prompt_counts
            )


_NONE = np.zeros(0, dtype=np.int64)


def _no_drafts(query_start: np.ndarray) -> np.ndarray:
    return _NONE


def _lora_off() -> AdapterError:
    return AdapterError("FAILED_PRECONDITION", "LoRA is not enabled (start with --enable-lora)")
