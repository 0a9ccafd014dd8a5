"""One-line builders for scheduler tests driven by fake step results (no model, no gRPC)."""
from __future__ import annotations

import itertools

import tokenizers
from tokenizers import models, pre_tokenizers, decoders

from scheduler_service.config import SchedulerConfig
from scheduler_service.engine.client import EngineFacts
from scheduler_service.text.outputs import OutputProcessor
from scheduler_service.core.plan import StepPlan, StepResult
from scheduler_service.core.request import Request, Sampling, Stopping
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.text.tokenizer import Tokenizer

EOS = 1
# Token id i decodes to the word WORDS[i]; words are joined by spaces.
WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(2, 200)]


def make_tokenizer() -> Tokenizer:
    vocab = {word: i for i, word in enumerate(WORDS)}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(["<eos>"])
    return Tokenizer(tokenizer.to_str(), chat_template="", special_tokens={})


def make_grammar_compiler():
    """outlines-core over the same word-level vocabulary (a token spells its word, no space)."""
    from scheduler_service.text.structured import GrammarCompiler
    vocab = {word: i for i, word in enumerate(WORDS)}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(["<eos>"])
    # outlines-core: llguidance needs a vocabulary that spells every byte, these words do not.
    return GrammarCompiler(tokenizer.to_str(), [EOS], len(WORDS), engine="outlines")


def plan_masks(plan) -> dict[int, list[int]]:
    """The allowed token ids a plan gives each masked slot (as a model service applies them)."""
    import numpy as np
    if not plan.masked_slots:
        return {}
    rows = np.frombuffer(plan.allowed_token_bitmask, dtype="<u4").reshape(len(plan.masked_slots), -1)
    return {slot: np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist()
            for slot, row in zip(plan.masked_slots, rows)}


def make_facts(num_blocks: int = 64, block_size: int = 4, max_num_slots: int = 16,
               max_model_len: int = 128, **facts) -> EngineFacts:
    """A fake model's Describe; `facts` sets any other EngineFacts field (step_token_budget...)."""
    return EngineFacts(
        model_name="fake", architecture="llama", dtype="float32", device="cpu",
        vocab_size=len(WORDS), max_model_len=max_model_len, block_size=block_size,
        num_kv_blocks=num_blocks, max_num_slots=max_num_slots, eos_token_ids=frozenset({EOS}),
        bos_token_id=None, tokenizer_json="", chat_template="", special_tokens={}, **facts)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int | None = 32,
                   max_num_seqs: int | None = 8, max_num_slots: int = 16,
                   max_model_len: int = 128, facts: EngineFacts | None = None, **config) -> Scheduler:
    """A scheduler over a fake model; `config` sets any other SchedulerConfig field; `facts`
    replaces the fake model's Describe (make_facts)."""
    config.setdefault("decode_reserve_tokens", 0)
    facts = facts or make_facts(num_blocks, block_size, max_num_slots, max_model_len)
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs, **config).validate()
    outputs = OutputProcessor(make_tokenizer(), facts.eos_token_ids, max_model_len)
    return Scheduler(config, facts, outputs)


_ids = itertools.count()


def make_request(num_prompt_tokens: int = 8, max_new_tokens: int = 4, *, stop=(),
                 stop_token_ids=(), ignore_eos: bool = False, request_id=None,
                 prompt_token_ids=None, **fields) -> Request:
    """`fields` sets any other Request field (priority, deadline, tenant, arrival_time...)."""
    return Request(
        request_id=request_id or f"r{next(_ids)}",
        prompt_token_ids=list(prompt_token_ids or [2 + i % 100 for i in range(num_prompt_tokens)]),
        sampling=Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0),
        stopping=Stopping(max_new_tokens=max_new_tokens, stop_strings=tuple(stop),
                          stop_token_ids=frozenset(stop_token_ids), ignore_eos=ignore_eos),
        **fields,
    )


class ShadowEngine:
    """Applies plans the way the model service does and checks them (slots registered once,
    block tables append-only and always large enough), so scheduler tests catch plans that
    a real model service would reject."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def apply(self, plan: StepPlan) -> None:
        for slot in plan.finished_slots + plan.preempted_slots + plan.aborted_slots:
            assert slot in self.tables, f"dropping unknown slot {slot}"
            del self.tables[slot], self.computed[slot]
        for seq in plan.new_sequences:
            assert seq.slot not in self.tables, f"slot {seq.slot} registered twice"
            self.tables[seq.slot], self.computed[seq.slot] = [], seq.num_computed_tokens
        offset = 0
        for slot, num_scheduled, num_new in zip(plan.slots, plan.num_scheduled_tokens,
                                                plan.num_new_blocks):
            self.tables[slot].extend(plan.new_block_ids[offset:offset + num_new])
            offset += num_new
            self.computed[slot] += num_scheduled
            assert len(self.tables[slot]) * self.block_size >= self.computed[slot], (
                f"slot {slot}: {len(self.tables[slot])} blocks for {self.computed[slot]} tokens")
        held = [b for table in self.tables.values() for b in table]
        assert 0 not in held, "block 0 is reserved"


def fake_result(plan: StepPlan, next_token=lambda request: 50) -> StepResult:
    """What a model service would answer: one token for each slot whose prompt is done."""
    counts, tokens = [], []
    for request, num_scheduled in zip(plan.requests, plan.num_scheduled_tokens):
        done = request.num_computed_tokens + num_scheduled >= request.num_tokens
        counts.append(1 if done else 0)
        if done:
            tokens.append(next_token(request))
    return StepResult(step_id=plan.step_id, num_sampled_tokens=counts, sampled_token_ids=tokens,
                      forward_ns=0, sample_ns=0, total_ns=0)


def run_step(scheduler: Scheduler, next_token=lambda request: 50):
    plan = scheduler.schedule()
    if not hasattr(scheduler, "shadow_engine"):
        scheduler.shadow_engine = ShadowEngine(scheduler.kv.block_size)
    scheduler.shadow_engine.apply(plan)
    outputs = scheduler.take_early_outputs() + scheduler.update(plan, fake_result(plan, next_token))
    return plan, outputs


def run_until_idle(scheduler: Scheduler, next_token=lambda request: 50, max_steps: int = 10_000):
    """Steps until nothing is left; returns the plans."""
    plans = []
    while scheduler.has_work():
        plans.append(run_step(scheduler, next_token)[0])
        assert len(plans) < max_steps, "the scheduler did not drain"
    return plans
