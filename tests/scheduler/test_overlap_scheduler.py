"""Overlap (Scheduler.commit / reconcile) against lockstep (schedule / update), driven by a
simulated model service that, like the real one, keeps each slot's tokens and feeds its own
samples to the next step: every request must get exactly the same tokens and finish the same
way, with stops, EOS, preemption, aborts and parallel samples in the mix, and no block left.
Grammar-constrained requests keep overlap on: the simulated model service samples them from
their plan's mask and checks that mask against one rebuilt from every token the slot holds."""
import collections
import random
import re

import numpy as np
import pytest

from factories import (EOS, WORDS, ShadowEngine, make_grammar_compiler, make_request, make_scheduler,
                       plan_masks)
from scheduler_service.core.plan import StepResult
from scheduler_service.core.request import FinishReason
from scheduler_service.text.structured import StructuredSpec

# A few tokens, then end of sequence; the model's choice matters at every step.
REGEX = "(w2|w3|w4)((w5|w6|w7)(w2|w3|w4)){2,8}"


def _allowed(row: np.ndarray) -> list[int]:
    bits = np.unpackbits(row.astype("<u4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def _mask_after(grammar, output_ids: list[int]) -> list[int]:
    """The mask a guide that took exactly `output_ids` gives: the up-to-date one."""
    guide = grammar.new_guide()
    for token_id in output_ids:
        assert guide.accept(token_id)
    row = np.zeros(grammar.num_words, dtype="<u4")
    guide.write_mask(row)
    return _allowed(row)


class ModelSim:
    """The model service's slot bookkeeping with a deterministic 'model': the next token is a
    function of the whole sequence, so a recomputed sequence samples the same token again."""

    def __init__(self, eos_every: int):
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.num_prompt: dict[int, int] = {}
        self.eos_every = eos_every
        self.max_tokens_seen = 0
        self.num_masked = 0

    def next_token(self, tokens: list[int], allowed=None) -> int:
        h = (sum(t * (i + 7) for i, t in enumerate(tokens)) * 2654435761) % 1000003
        if allowed is not None:
            return allowed[h % len(allowed)]
        return EOS if self.eos_every and h % self.eos_every == 0 else 2 + h % 150

    def _mask_of(self, request, slot: int, masks: dict[int, list[int]]):
        if request.guide is None:
            return None
        assert slot in masks, f"slot {slot}: a constrained sequence sampled without a mask"
        outputs = self.tokens[slot][self.num_prompt[slot]:]
        assert masks[slot] == _mask_after(request.guide.grammar, outputs), "a stale mask"
        self.num_masked += 1
        return masks[slot]

    def execute(self, plan) -> StepResult:
        for slot in plan.finished_slots + plan.preempted_slots + plan.aborted_slots:
            del self.tokens[slot], self.computed[slot]
        for seq in plan.new_sequences:
            assert seq.slot not in self.tokens
            self.tokens[seq.slot], self.computed[seq.slot] = list(seq.token_ids), seq.num_computed_tokens
            self.num_prompt[seq.slot] = seq.num_prompt_tokens
        counts, sampled = [], []
        masks = plan_masks(plan)
        for request, slot, n in zip(plan.requests, plan.slots, plan.num_scheduled_tokens):
            self.computed[slot] += n
            tokens = self.tokens[slot]
            assert self.computed[slot] <= len(tokens), "scheduled past the known tokens"
            if self.computed[slot] == len(tokens):
                tokens.append(self.next_token(tokens, self._mask_of(request, slot, masks)))
                self.max_tokens_seen = max(self.max_tokens_seen, len(tokens))
                counts.append(1), sampled.append(tokens[-1])
            else:
                counts.append(0)
        return StepResult(step_id=plan.step_id, num_sampled_tokens=counts, sampled_token_ids=sampled,
                          forward_ns=0, sample_ns=0, total_ns=0)


def _workload(seed: int, constrained: bool = False):
    """40 requests arriving over 60 steps; with `constrained`, a third of them under REGEX."""
    rng = random.Random(seed)
    arrivals = collections.defaultdict(list)
    for index in range(40):
        spec = dict(
            num_prompt_tokens=rng.randrange(1, 40), max_new_tokens=rng.randrange(1, 30),
            stop_token_ids=(rng.randrange(2, 152),) if rng.random() < 0.3 else (),
            n=2 if rng.random() < 0.15 else 1, request_id=f"q{index}")
        if constrained and rng.random() < 0.35:
            spec.update(structured=StructuredSpec("regex", REGEX), stop_token_ids=())
        arrivals[rng.randrange(0, 60)].append(spec)
    arrived_at = {spec["request_id"]: step for step, specs in arrivals.items() for spec in specs}
    # A few requests aborted a few steps after they arrive (usually mid-generation).
    aborts = {arrived_at[f"q{i}"] + rng.randrange(2, 6): f"q{i}" for i in rng.sample(range(40), 5)}
    return arrivals, aborts


def _run(overlap: bool, seed: int, eos_every: int, num_blocks: int, with_aborts: bool = False,
         grammars=None):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=24, max_num_seqs=8)
    model, shadow = ModelSim(eos_every), ShadowEngine(4)
    arrivals, aborts = _workload(seed, constrained=grammars is not None)
    if not with_aborts:  # an abort lands at a loop iteration: its effect depends on timing
        aborts = {}
    tokens = collections.defaultdict(list)
    finished = {}
    in_flight = collections.deque()
    step = 0

    def take(outputs):
        for request, output in outputs:
            key = (request.public_id, output.index)
            tokens[key].extend(output.token_ids)
            if output.finish_reason is not None:
                finished[key] = output.finish_reason

    max_in_flight = 0
    while step <= 60 or scheduler.has_work() or in_flight:
        assert step < 5000, "did not drain"
        for spec in arrivals.get(step, []):
            request = make_request(**spec)
            if request.structured is not None:
                request.guide = grammars.compile(request.structured).new_guide()
            scheduler.add_request(request)
        if step in aborts:
            scheduler.abort_request(aborts[step])
        step += 1
        if not overlap:
            plan = scheduler.schedule()
            take(scheduler.take_early_outputs())
            shadow.apply(plan)
            take(scheduler.update(plan, model.execute(plan)))
            continue
        if len(in_flight) < 2 and scheduler.has_work():
            plan = scheduler.schedule()
            take(scheduler.take_early_outputs())
            if not plan.is_empty:
                scheduler.commit(plan)
                shadow.apply(plan)
                in_flight.append((plan, model.execute(plan)))  # computed now, read later
                if grammars is None or any(r.guide for r in scheduler.running):
                    max_in_flight = max(max_in_flight, len(in_flight))
                if len(in_flight) < 2:
                    continue
        if in_flight:
            plan, result = in_flight.popleft()
            take(scheduler.reconcile(plan, result))
    kv = scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    assert not scheduler.requests
    every = {(spec["request_id"], i) for specs in arrivals.values() for spec in specs for i in range(spec["n"])}
    assert set(finished) == every, "a sample ended without its last chunk"
    if grammars is not None:
        assert model.num_masked > 0
    return dict(tokens), finished, scheduler.num_preemptions_total, max_in_flight


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [24, 200])  # 24: preemptions; 200: prefix-cache hits
def test_overlap_gives_exactly_the_lockstep_outputs(seed, num_blocks):
    lockstep_tokens, lockstep_finished, _, _ = _run(False, seed, eos_every=23, num_blocks=num_blocks)
    tokens, finished, preemptions, max_in_flight = _run(True, seed, eos_every=23, num_blocks=num_blocks)
    assert max_in_flight == 2
    assert finished == lockstep_finished
    assert tokens == lockstep_tokens


@pytest.fixture(scope="module")
def grammars():
    return make_grammar_compiler()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [24, 200])
def test_constrained_requests_keep_two_plans_in_flight_with_up_to_date_masks(seed, num_blocks,
                                                                             grammars):
    """Overlap stays on while grammars run (two plans in flight with a constrained sequence
    running); every constrained sample had the mask of all its tokens so far (ModelSim checks),
    and everything equals lockstep, with preemptions (24 blocks) and parallel samples."""
    lockstep = _run(False, seed, eos_every=23, num_blocks=num_blocks, grammars=grammars)
    tokens, finished, _, max_in_flight = _run(True, seed, eos_every=23, num_blocks=num_blocks,
                                              grammars=grammars)
    assert max_in_flight == 2
    assert (tokens, finished) == lockstep[:2]
    specs = {spec["request_id"]: spec for specs in _workload(seed, True)[0].values() for spec in specs}
    num_complete = 0
    for (request_id, _), reason in finished.items():
        assert reason is not FinishReason.ERROR
        if specs[request_id].get("structured") is not None and reason is FinishReason.EOS:
            text = "".join(WORDS[t] for t in tokens[(request_id, _)][:-1])
            assert re.fullmatch(REGEX, text), text
            num_complete += 1
    assert num_complete > 0


@pytest.mark.parametrize("seed", range(3))
def test_aborts_of_constrained_requests_with_plans_in_flight_leak_nothing(seed, grammars):
    _, finished, _, _ = _run(True, seed, eos_every=23, num_blocks=24, with_aborts=True,
                             grammars=grammars)
    assert FinishReason.CANCELLED in finished.values()


def test_the_small_pool_does_preempt_under_overlap():
    assert any(_run(True, seed, eos_every=23, num_blocks=24)[2] for seed in range(6))


@pytest.mark.parametrize("seed", range(4))
def test_aborts_while_plans_are_in_flight_end_every_request_and_leak_nothing(seed):
    _, finished, _, _ = _run(True, seed, eos_every=23, num_blocks=24, with_aborts=True)
    assert 4 in finished.values()  # FinishReason.CANCELLED: some abort hit a live request


def test_a_request_that_stops_while_its_next_step_is_in_flight_gets_no_extra_token():
    scheduler = make_scheduler()
    model = ModelSim(eos_every=0)
    request = make_request(num_prompt_tokens=5, max_new_tokens=3)
    scheduler.add_request(request)
    plans, outputs = [], []
    while scheduler.has_work() or plans:
        if len(plans) < 2 and scheduler.has_work():
            plan = scheduler.schedule()
            if not plan.is_empty:
                scheduler.commit(plan)
                plans.append((plan, model.execute(plan)))
                if len(plans) < 2:
                    continue
        plan, result = plans.pop(0)
        outputs += scheduler.reconcile(plan, result)
    generated = [t for _, o in outputs for t in o.token_ids]
    assert len(generated) == 3 and outputs[-1][1].finish_reason is not None
    # The model service did compute a fourth token (planned before the stop was known): the
    # slot's tokens there ran one past what the client got, and were dropped with the slot.
    assert model.max_tokens_seen == 5 + 4
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_ends_in_its_first_step_leaves_its_prompt_blocks_cached(overlap):
    """max_tokens 1 (prefill-only traffic): the prompt's full blocks enter the prefix cache, as in
    vLLM, and the event log reports them stored. Overlap once released the slot before it
    registered the plan's blocks, so such a request cached nothing."""
    scheduler = make_scheduler(block_size=4)
    scheduler.kv.enable_events()
    scheduler.kv.pool.take_events()  # nothing yet
    prompt = list(range(2, 12))  # 10 tokens: 2 full blocks and 2 tokens left over
    scheduler.add_request(make_request(prompt_token_ids=prompt, max_new_tokens=1))
    model = ModelSim(eos_every=0)
    plan = scheduler.schedule()
    if overlap:
        scheduler.commit(plan)
        outputs = scheduler.reconcile(plan, model.execute(plan))
    else:
        outputs = scheduler.update(plan, model.execute(plan))
    assert [o.finish_reason for _, o in outputs] == [2]  # LENGTH, after the first step
    again = make_request(prompt_token_ids=prompt, max_new_tokens=1)
    assert scheduler.kv.num_cached_prefix_tokens(again) == 8
    events, lost = scheduler.kv.pool.take_events()
    hashes = scheduler.kv.pool.block_hashes(prompt, 4)
    assert not lost and [e[:2] for e in events] == [(1, hashes[0]), (1, hashes[1])]
    assert [e[3] for e in events] == [prompt[:4], prompt[4:8]]
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_commit_adds_a_placeholder_for_each_sampling_entry_not_held():
    """StepCore.add_placeholders, commit's loop: a sampling entry gets token 0 appended and its
    index in the map; a held (constrained) one maps to None and gets nothing; a prompt chunk
    that does not reach its end samples nothing and is left out."""
    scheduler = make_scheduler(max_num_batched_tokens=32, num_blocks=64)
    for i, num_prompt_tokens in enumerate([4, 4, 40]):
        scheduler.add_request(make_request(num_prompt_tokens, 4, request_id=f"r{i}"))
    plan = scheduler.schedule()
    core = scheduler.core
    expected = core.sampling_entries(plan.packed)
    assert expected == [1, 1, 0]
    before = [core.num_tokens(slot) for slot in plan.slots]
    core.advance(plan.packed, expected, cache_blocks=False)
    assert core.add_placeholders(plan.packed, expected, {1}) == {0: before[0], 1: None}
    assert [core.num_tokens(slot) for slot in plan.slots] == [before[0] + 1, before[1], before[2]]
    with pytest.raises(ValueError, match="2 sampling flags for a plan of 3"):
        core.add_placeholders(plan.packed, expected[:2], None)
