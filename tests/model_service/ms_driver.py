"""A minimal stand-in for the scheduler: builds StepPlans for a ModelRunner and mirrors slot state.

Blocks come from a counter (never freed), which is enough for short tests.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from model_service.step.plan import LogitsProcessing, PlanArrays, SlotRegistration

_EMPTY = np.zeros(0, dtype=np.int64)


def _a(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@dataclasses.dataclass
class Seq:
    tokens: list[int]
    prompt_len: int
    computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Driver:
    def __init__(self, runner, block_size: int = 16) -> None:
        self.runner = runner
        self.block_size = block_size
        self.next_block = 1
        self.step_id = 0
        self.seqs: dict[int, Seq] = {}
        self._pending_new: list[SlotRegistration] = []
        self._pending_drop: list[int] = []
        self._preset: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}  # slot -> each sampled token's logprob (with_logprobs)
        self._num_logprobs: dict[int, int] = {}

    def add(self, slot, token_ids, temperature=0.0, top_k=0, top_p=1.0, seed=0, computed=0, blocks=(),
            with_logprobs=False, lora_id=0, num_logprobs=0, processing=None) -> None:
        """Register a sequence; `blocks` are cached blocks holding its first `computed` tokens;
        with_logprobs records the logprob of each token sampled for it in self.logprobs (each
        with num_logprobs alternatives beside, in the result only); lora_id: the adapter it runs
        (0: the base model); processing: its LogitsProcessing, when not only logprobs."""
        self.seqs[slot] = Seq(list(token_ids), len(token_ids), computed)
        self._preset[slot] = list(blocks)
        if with_logprobs:
            processing = LogitsProcessing(num_prompt_tokens=len(token_ids), num_logprobs=num_logprobs)
        if with_logprobs:
            self.logprobs[slot] = []
            self._num_logprobs[slot] = num_logprobs
        self._pending_new.append(
            SlotRegistration(slot, np.asarray(token_ids, dtype=np.int32), computed, temperature, top_k, top_p, seed,
                            processing, lora_id=lora_id)
        )

    def finish(self, slot) -> None:
        self._pending_drop.append(slot)
        del self.seqs[slot]

    def step(self, schedule: dict[int, int]):
        """schedule: slot -> tokens to compute this step. Returns {slot: sampled token} for sampled slots."""
        slots, counts, num_new, new_ids = [], [], [], []
        for slot, n in schedule.items():
            seq = self.seqs[slot]
            ids = self._preset.pop(slot, [])  # cached blocks handed over at registration
            need = -(-(seq.computed + n) // self.block_size) - len(seq.blocks) - len(ids)
            if need > 0:
                ids += range(self.next_block, self.next_block + need)
                self.next_block += need
            seq.blocks += ids
            slots.append(slot), counts.append(n), num_new.append(len(ids)), new_ids.extend(ids)
        plan = PlanArrays(
            self.step_id, self._pending_new, _a(slots), _a(counts), _a(num_new), _a(new_ids),
            _a(self._pending_drop), _EMPTY, _EMPTY, _EMPTY, _EMPTY,
        )
        self.step_id += 1
        self._pending_new, self._pending_drop = [], []
        out = self.runner.execute(plan)
        sampled, at, logprob_at = {}, 0, 0
        for slot, n, k in zip(slots, counts, out.num_sampled_tokens):
            seq = self.seqs[slot]
            seq.computed += n
            if k:
                seq.tokens.append(int(out.sampled_token_ids[at]))
                sampled[slot] = seq.tokens[-1]
                at += 1
                if slot in self.logprobs:  # per sampled row, in plan order: its own, then the top
                    self.logprobs[slot].append(float(out.logprobs[logprob_at]))
                    logprob_at += 1 + self._num_logprobs[slot]
        return sampled

    def run_to_completion(self, max_new_tokens: int, chunk: int = 32, joins: dict[int, list] | None = None,
                          with_logprobs: bool = False, lora_ids: dict[int, int] | None = None) -> dict[int, list[int]]:
        """Step until every sequence has max_new_tokens; prefills go in chunks of `chunk`.

        joins: {step index: [(slot, token_ids), ...]} sequences registered at that step, while the
        others are mid-prefill or decoding."""
        joins = dict(joins or {})
        done: dict[int, list[int]] = {}
        step = 0
        while self.seqs or joins:
            for slot, tokens in joins.pop(step, []):
                self.add(slot, tokens, with_logprobs=with_logprobs, lora_id=(lora_ids or {}).get(slot, 0))
            schedule = {s: min(chunk, len(q.tokens) - q.computed) for s, q in self.seqs.items()}
            self.step(schedule)
            for slot, seq in list(self.seqs.items()):
                if len(seq.generated) >= max_new_tokens:
                    done[slot] = seq.generated[:max_new_tokens]
                    self.finish(slot)
            step += 1
        return done


class Recording:
    """A lockstep runner's execute, each plan and its result kept, for replay_ahead. With
    `mark_plain`, a plan without registrations or drops is marked plain, as the scheduler marks
    it."""

    def __init__(self, runner, mark_plain: bool = False) -> None:
        self.runner, self.mark_plain = runner, mark_plain
        self.steps: list[tuple[PlanArrays, object]] = []

    def execute(self, plan: PlanArrays):
        if self.mark_plain:
            plain = not (plan.new_sequences or plan.finished_slots.size)
            plan = dataclasses.replace(plan, plain=plain)
        output = self.runner.execute(plan)
        self.steps.append((plan, output))
        return output


def replay_ahead(runner, steps: list[tuple[PlanArrays, object]]) -> list:
    """Each recorded plan through runner.step_ahead, launched behind the one before it where
    launch-ahead allows: every step's result, in plan order."""
    results, in_flight = [], None
    for plan, _ in steps:
        done, in_flight = runner.step_ahead(plan, in_flight)
        results += done
    if in_flight is not None:
        results.append(runner.finish(in_flight))
    return results
