"""Parking (core/lora_parking.py, lora_park_after_steps): with more adapters in use than
max_loras places, adapters take turns and a running sequence out of turn sits the step out,
keeping its slot and its blocks. Checked: every plan has at most max_loras distinct adapters
(also under overlap, with parallel samples and stops), parked sequences keep their blocks and
resume with the tokens of an undisturbed run and no preemption, an aborted parked request frees
its blocks, a parked sequence can still be the victim when blocks run out, no adapter starves,
and vllm:lora_requests_info reports a parked adapter as waiting.

The model service is ModelSim (test_overlap_scheduler.py): it keeps each slot's tokens itself,
as the real one does, and its next token is a function of the whole sequence, so a sequence
that lost or repeated a token across a park (or a preemption) ends with other tokens.
"""

from __future__ import annotations

import collections
import random

import pytest

from scheduler_service.core.lora_admission import lora_blocked
from scheduler_service.core.request import RequestStatus
from scheduler_service.text.structured import StructuredSpec
from tests.scheduler.factories import ShadowEngine, make_grammar_compiler
from tests.scheduler.test_lora_scheduling import Loads, lora_request, lora_scheduler
from tests.scheduler.test_lora_scheduling import step as checked_step
from tests.scheduler.test_overlap_scheduler import REGEX, ModelSim

NAMES = "ABCDEFGH"


def _workload(seed: int, num_requests: int = 48, constrained: bool = False):
    """Requests on 8 adapters and the base model arriving over 40 steps; a few with n = 2 or
    a stop token; with `constrained`, a third under a grammar (REGEX)."""
    rng = random.Random(seed)
    arrivals = collections.defaultdict(list)
    for index in range(num_requests):
        spec = dict(
            name=rng.choice(NAMES + " ").strip(),
            num_prompt_tokens=rng.randrange(1, 30),
            max_new_tokens=rng.randrange(1, 20),
            stop_token_ids=(rng.randrange(2, 152),) if rng.random() < 0.2 else (),
            n=2 if rng.random() < 0.15 else 1,
            request_id=f"q{index}",
        )
        if constrained and rng.random() < 0.35:
            spec.update(structured=StructuredSpec("regex", REGEX), stop_token_ids=())
        arrivals[rng.randrange(0, 40)].append(spec)
    return arrivals


def _run(seed, park, overlap, max_loras=2, num_blocks=400, max_cpu_loras=8, grammars=None):
    """Runs the workload (lockstep or two plans in flight; with `grammars`, constrained
    requests too); checks every plan's adapters; returns (tokens by (request, sample),
    preemptions, the most sequences parked in a step)."""
    scheduler = lora_scheduler(
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        num_blocks=num_blocks,
        lora_park_after_steps=park,
        lora_rotate_after_steps=0 if park else 8,
    )
    loads, shadow = Loads(scheduler), ShadowEngine(4)
    model = ModelSim(eos_every=0 if grammars is None else 23)
    arrivals = _workload(seed, constrained=grammars is not None)
    tokens = collections.defaultdict(list)
    in_flight = collections.deque()
    most_parked, step = 0, 0

    def take(outputs):
        for request, output in outputs:
            tokens[(request.public_id, output.index)].extend(output.token_ids)

    while step <= 40 or scheduler.has_work() or in_flight:
        assert step < 5000, "did not drain"
        for spec in arrivals.get(step, []):
            spec = dict(spec)
            request = lora_request(spec.pop("name"), **spec)
            if request.structured is not None:
                request.guide = grammars.compile(request.structured).new_guide()
            scheduler.add_request(request)
        step += 1
        if scheduler.has_work() and len(in_flight) < (2 if overlap else 1):
            plan = scheduler.schedule()
            take(scheduler.take_early_outputs())
            names = {r.lora_name for r in plan.requests if r.lora_name}
            assert len(names) <= max_loras, f"step {plan.step_id} ran {sorted(names)}"
            most_parked = max(most_parked, scheduler.loras.turns.num_parked)
            if overlap:
                scheduler.commit(plan)
            shadow.apply(plan)
            in_flight.append((plan, model.execute(plan)))
            loads.complete()
            if overlap and len(in_flight) < 2:
                continue
        if in_flight:
            plan, result = in_flight.popleft()
            apply = scheduler.reconcile if overlap else scheduler.update
            take(apply(plan, result))
    kv = scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    assert not scheduler.requests and not scheduler.loras.running
    return dict(tokens), scheduler.num_preemptions_total, most_parked


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("overlap", [False, True])
def test_parked_sequences_resume_with_the_tokens_of_an_undisturbed_run(seed, overlap):
    alone, _, _ = _run(seed, park=0, overlap=False, max_loras=8)  # every adapter has a place
    parked, preemptions, most_parked = _run(seed, park=2, overlap=overlap)
    assert most_parked > 0, "nothing was parked: the test shows nothing"
    assert preemptions == 0
    assert parked == alone


@pytest.fixture(scope="module")
def grammars():
    return make_grammar_compiler()


@pytest.mark.parametrize("seed", range(2))
def test_constrained_sequences_park_and_resume_with_up_to_date_masks(seed, grammars):
    # ModelSim checks every constrained sample's mask against all the slot's tokens so far.
    alone, _, _ = _run(seed, park=0, overlap=False, max_loras=8, grammars=grammars)
    parked, preemptions, most_parked = _run(seed, park=1, overlap=True, grammars=grammars)
    assert most_parked > 0 and preemptions == 0
    assert parked == alone


def test_a_parked_sequence_keeps_its_blocks_and_counts_and_resumes():
    scheduler = lora_scheduler(max_loras=1, lora_park_after_steps=2)
    loads = Loads(scheduler)
    a = lora_request("A", max_new_tokens=30)
    b = lora_request("B", max_new_tokens=30)
    scheduler.add_request(a)
    for _ in range(3):
        checked_step(scheduler, loads, 1)
    scheduler.add_request(b)
    seen_parked = False
    while a.status is RequestStatus.RUNNING and b.status is not RequestStatus.FINISHED:
        blocks, computed = list(a.block_ids), a.num_computed_tokens
        plan = checked_step(scheduler, loads, 1)
        if a.lora_parked_step == plan.step_id:
            seen_parked = True
            assert a not in plan.requests and b in plan.requests
            assert list(a.block_ids) == blocks and a.num_computed_tokens == computed
            assert scheduler.loras.running_names() == ["B"]
            assert "A" in scheduler.loras.waiting_names()
    assert seen_parked
    while scheduler.has_work():
        checked_step(scheduler, loads, 1)
    assert len(a.output_token_ids) == 30 and len(b.output_token_ids) == 30
    assert scheduler.num_preemptions_total == 0


def test_an_aborted_parked_request_frees_its_blocks():
    scheduler = lora_scheduler(max_loras=1, lora_park_after_steps=2)
    loads = Loads(scheduler)
    a = lora_request("A", num_prompt_tokens=20, max_new_tokens=40)
    b = lora_request("B", max_new_tokens=40)
    scheduler.add_request(a)
    for _ in range(3):
        checked_step(scheduler, loads, 1)
    scheduler.add_request(b)
    while True:
        plan = checked_step(scheduler, loads, 1)
        if a.lora_parked_step == plan.step_id:
            break
    held = len(a.block_ids)
    assert held > 0
    free = scheduler.kv.num_free_blocks
    assert scheduler.abort_request(a.request_id)
    plan = checked_step(scheduler, loads, 1)
    assert a.status is RequestStatus.FINISHED and a.slot is None
    assert a.slot not in plan.slots
    # B's step may take a block of its own; A's are back.
    assert scheduler.kv.num_free_blocks >= free + held - 1
    while scheduler.has_work():
        checked_step(scheduler, loads, 1)
    kv = scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks and not scheduler.loras.running


def test_when_blocks_run_out_a_parked_sequence_may_be_the_victim():
    # Few blocks: the running sequences outgrow them; the victims (fcfs: the latest admitted)
    # include parked ones, and every request still ends with its undisturbed tokens.
    alone, _, _ = _run(5, park=0, overlap=False, max_loras=8)
    parked, preemptions, most_parked = _run(5, park=2, overlap=False, num_blocks=40)
    assert preemptions > 0 and most_parked > 0
    assert parked == alone


def test_no_adapter_starves_when_the_popular_ones_pin_every_loaded_slot():
    # Two popular adapters always have sequences holding slots (parked or running), and only
    # two adapters fit loaded: the rare one needs an eviction, so an adapter must drain.
    scheduler = lora_scheduler(
        max_loras=1, max_cpu_loras=2, lora_park_after_steps=2, lora_max_skipped_steps=8
    )
    loads = Loads(scheduler)
    rare = lora_request("C", max_new_tokens=2)
    started = None
    for number in range(300):
        for name in ("A", "B"):
            scheduler.add_request(lora_request(name, num_prompt_tokens=4, max_new_tokens=4))
        if number == 3:
            scheduler.add_request(rare)
        checked_step(scheduler, loads, 1)
        if rare.status is not RequestStatus.WAITING:
            started = number
            break
    assert started is not None, "the rare adapter never started"
    assert "C" in loads.loaded


def test_parking_off_keeps_running_adapters_within_max_loras():
    scheduler = lora_scheduler(max_loras=2, lora_park_after_steps=0)
    loads = Loads(scheduler)
    for i in range(12):
        scheduler.add_request(lora_request("ABCD"[i % 4], max_new_tokens=6))
    while scheduler.has_work():
        checked_step(scheduler, loads, 2)  # checks the running adapters without parking
        assert scheduler.loras.turns.num_parked == 0


def test_an_adapter_in_turn_that_was_evicted_loads_again_before_it_admits():
    # Its turn was held by waiting requests only, so it was idle and could be evicted.
    scheduler = lora_scheduler(max_loras=2, lora_park_after_steps=1)
    loras = scheduler.loras
    loras.turns.on = True
    loras.turns.begin("A", 1)
    request = lora_request("A")
    assert "A" not in loras.resident
    assert lora_blocked(loras, request) == "load"
    loras.resident["A"] = 1
    assert lora_blocked(loras, request) is None
