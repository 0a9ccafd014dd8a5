"""Preemptive LoRA rotation (core/lora_admission.py, core/loras.py: lora_preempt_after_steps):
an adapter that held its place a quantum while others waited that long is preempted and its
place kept for the adapter that waited longest. Checked on every step: max_loras holds, no
adapter loses its place before it held it a quantum; at the end: every request finished with
the tokens of an undisturbed run, no block leaked, no adapter starved.

The model service is the fake one of factories.py (with the shadow engine checking each plan's
slots and blocks); its next token depends on the sequence's tokens, so a request that lost
or repeated a token across a preemption would end with other tokens.
"""

from __future__ import annotations

import random

import pytest

from scheduler_service.core.lora_admission import lora_blocked
from scheduler_service.core.request import RequestStatus
from tests.scheduler.test_lora_scheduling import POLICIES, Loads, lora_request, lora_scheduler
from tests.scheduler.test_lora_scheduling import step as checked_step


def next_token(request):
    """A function of the sequence so far: a recompute that lost or repeated a token differs."""
    tokens = request.all_token_ids
    return (sum(tokens) * 31 + len(tokens)) % 97 + 3


class Watch:
    """Steps a scheduler, checking max_loras and the quantum; records who was preempted."""

    def __init__(self, scheduler, max_loras, quantum):
        self.scheduler, self.max_loras, self.quantum = scheduler, max_loras, quantum
        self.loads = Loads(scheduler)
        self.since: dict[str, int] = {}  # adapter -> the step it took its place
        self.preempted: dict[str, int] = {}  # adapter -> times it lost its place
        self.steps = 0
        self.swapped_out = 0

    def step(self):
        scheduler = self.scheduler
        before = {r.request_id: r.num_preemptions for r in scheduler.running}
        rotations = scheduler.num_lora_rotations_total
        plan = checked_step(scheduler, self.loads, self.max_loras, next_token)
        self.steps += 1
        self.swapped_out += len(plan.swap_out_dst)
        running = {r.lora_name for r in scheduler.running if r.lora_name}
        # Adapters that lost their place to a rotation (a priority policy's own preemptions
        # take single sequences, for a higher-ranked request, whatever their adapter held).
        lost = {
            r.lora_name
            for r in scheduler.requests.values()
            if r.num_preemptions > before.get(r.request_id, r.num_preemptions)
            and r.lora_name not in running
        }
        assert len(lost) == scheduler.num_lora_rotations_total - rotations, lost
        for name in lost:
            held = plan.step_id - self.since[name]
            assert held >= self.quantum, f"{name} lost its place after {held} steps"
            self.preempted[name] = self.preempted.get(name, 0) + 1
        self.since = {n: self.since.get(n, plan.step_id) for n in running}
        return plan

    def run(self, max_steps=5000):
        while self.scheduler.has_work():
            self.step()
            assert self.steps < max_steps, "the scheduler did not drain"


def drained(scheduler):
    kv = scheduler.kv
    return (
        not scheduler.requests
        and kv.num_free_blocks == kv.num_usable_blocks
        and not scheduler.loras.running
        and not scheduler.loras.in_flight
        and not scheduler.loras.promised
    )


def test_a_waiting_adapter_preempts_the_one_that_held_its_place_a_quantum():
    scheduler = lora_scheduler(max_loras=1, lora_preempt_after_steps=4)
    watch = Watch(scheduler, 1, 4)
    long = [lora_request("A", max_new_tokens=40) for _ in range(3)]
    for request in long:
        scheduler.add_request(request)
    for _ in range(3):
        watch.step()
    assert all(r.status is RequestStatus.RUNNING for r in long)
    waiting = lora_request("B", max_new_tokens=3)
    scheduler.add_request(waiting)
    steps = 0
    while not waiting.output_token_ids:
        watch.step()
        steps += 1
    # About a quantum of waiting, then the step it starts in (and its adapter's load).
    assert steps <= 4 + 3
    assert all(r.num_preemptions == 1 and r.status is RequestStatus.WAITING for r in long)
    assert watch.preempted == {"A": 1}
    watch.run()
    assert drained(scheduler)
    assert all(len(r.output_token_ids) == 40 for r in long)


def test_without_the_flag_nothing_is_preempted():
    scheduler = lora_scheduler(max_loras=1, lora_rotate_after_steps=0)
    watch = Watch(scheduler, 1, 0)
    for name in "AB":
        scheduler.add_request(lora_request(name, max_new_tokens=20))
    watch.run()
    assert scheduler.num_preemptions_total == 0 and drained(scheduler)


def workload(seed, count=48):
    rng = random.Random(seed)
    return [
        dict(
            name=rng.choice(["", "A", "B", "C", "D", "E", "F"]),
            num_prompt_tokens=rng.randint(3, 30),
            max_new_tokens=rng.randint(1, 30),
            priority=rng.randint(0, 2),
            tenant=rng.choice(["t1", "t2"]),
            arrival=rng.randint(0, 40),
        )
        for _ in range(count)
    ]


def run_workload(specs, max_loras, quantum, policy="fcfs", max_cpu_loras=4, num_swap_blocks=0):
    """Runs `specs` (arriving at their steps); returns (tokens by index, watch)."""
    scheduler = lora_scheduler(
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        num_swap_blocks=num_swap_blocks,
        policy=policy,
        lora_preempt_after_steps=quantum,
        lora_rotate_after_steps=0,
    )
    watch = Watch(scheduler, max_loras, quantum)
    requests = []
    pending = sorted(enumerate(specs), key=lambda item: item[1]["arrival"])
    while pending or scheduler.has_work():
        while pending and pending[0][1]["arrival"] <= watch.steps:
            _, spec = pending.pop(0)
            fields = {k: v for k, v in spec.items() if k not in ("name", "arrival")}
            request = lora_request(spec["name"], **fields)
            requests.append(request)
            scheduler.add_request(request)
        watch.step()
        assert watch.steps < 5000, "the scheduler did not drain"
    assert drained(scheduler)
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    return [list(r.output_token_ids) for r in requests], watch


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_with_the_tokens_of_an_undisturbed_run(policy):
    specs = workload(seed=11)
    # Undisturbed: a place for every adapter, so nothing waits and nothing is preempted.
    alone, quiet = run_workload(specs, max_loras=6, quantum=2, policy=policy, max_cpu_loras=6)
    assert quiet.preempted == {} and quiet.scheduler.num_lora_rotations_total == 0
    rotated, watch = run_workload(specs, max_loras=2, quantum=2, policy=policy)
    assert sum(watch.preempted.values()) > 0, "the workload never rotated"
    assert rotated == alone


def test_swap_preemption_keeps_the_tokens_too():
    specs = workload(seed=5)
    alone, _ = run_workload(specs, max_loras=6, quantum=3, max_cpu_loras=6)
    rotated, watch = run_workload(specs, max_loras=2, quantum=3, num_swap_blocks=512)
    assert sum(watch.preempted.values()) > 0 and rotated == alone
    assert watch.swapped_out > 0, "no preemption went by swap"


def test_no_adapter_is_starved_either_way():
    """Three adapters with a steady stream each over two places: each gets a place again after
    losing it, and the waits stay within a few quanta (no starvation of the preempted one,
    nor of the waiting ones)."""
    quantum = 3
    scheduler = lora_scheduler(
        max_loras=2, lora_preempt_after_steps=quantum, lora_max_skipped_steps=10_000
    )
    watch = Watch(scheduler, 2, quantum)
    last_start = {name: 0 for name in "ABC"}
    longest = 0
    for number in range(200):
        for name in "ABC":
            scheduler.add_request(lora_request(name, num_prompt_tokens=4, max_new_tokens=12))
        watch.step()
        for name in {r.lora_name for r in scheduler.running}:
            longest = max(longest, number - last_start[name])
            last_start[name] = number
    assert all(watch.preempted.get(name, 0) >= 10 for name in "ABC"), watch.preempted
    assert longest <= 4 * quantum, longest


def test_a_promised_place_is_free_again_once_its_requests_are_gone():
    scheduler = lora_scheduler(max_loras=2, lora_preempt_after_steps=2)
    watch = Watch(scheduler, 2, 2)
    for name in "AD":
        scheduler.add_request(lora_request(name, max_new_tokens=30))
    watch.step()
    watch.step()
    loras = scheduler.loras
    # One place runs A, the other (D's, as if preempted) was promised to C, whose requests were
    # then aborted before they took it: D's next request is held back only while it lasts.
    later = lora_request("D", max_new_tokens=2)
    loras.running.pop("D")
    loras.promised.add("C")
    assert lora_blocked(loras, later) == "full"
    loras.lapse_promises()
    assert not loras.promised and lora_blocked(loras, later) is None
