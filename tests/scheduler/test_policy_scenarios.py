"""One scenario per policy that plain FCFS gets wrong, run through the whole scheduler."""
import time

import pytest
from factories import make_request, make_scheduler, run_step, run_until_idle

from scheduler_service.core.request import FinishReason


class FakeClock:
    """Stands in for time.monotonic so that deadlines follow steps, not the machine's speed."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(time, "monotonic", fake)
    return fake


def _steps_to_first_token(scheduler, request, max_steps=500):
    for step in range(1, max_steps):
        run_step(scheduler)
        if request.output_token_ids:
            return step
    raise AssertionError("no first token")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_urgent_request_gets_its_first_token_at_once_only_under_priority(policy, clock):
    scheduler = make_scheduler(max_num_seqs=4, policy=policy)
    for i in range(4):
        scheduler.add_request(make_request(max_new_tokens=40, arrival_time=clock.now + i))
    run_step(scheduler)  # four low-priority requests hold every sequence slot
    urgent = make_request(max_new_tokens=4, priority=10, arrival_time=clock.now + 10)
    scheduler.add_request(urgent)
    steps = _steps_to_first_token(scheduler, urgent)
    if policy == "priority":
        assert steps == 1  # a running request was preempted for it
    else:
        assert steps > 30  # it waited for a running request to finish
    run_until_idle(scheduler)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_priority_preempts_the_lowest_priority_latest_arrival_and_it_resumes(clock):
    scheduler = make_scheduler(max_num_seqs=3, policy="priority")
    low_early = make_request(max_new_tokens=20, priority=1, arrival_time=1.0)
    lowest = make_request(max_new_tokens=20, priority=0, arrival_time=2.0)
    low_late = make_request(max_new_tokens=20, priority=1, arrival_time=3.0)
    for request in (low_early, lowest, low_late):
        scheduler.add_request(request)
    run_step(scheduler)
    lowest_slot = lowest.slot
    urgent = make_request(max_new_tokens=5, priority=5, arrival_time=4.0)
    scheduler.add_request(urgent)
    plan, _ = run_step(scheduler)
    assert plan.preempted_slots == [lowest_slot]
    assert lowest.num_preemptions == 1 and urgent in plan.requests
    run_until_idle(scheduler)
    assert len(lowest.output_token_ids) == 20  # resumed and finished


def _deadline_race(scheduler, clock):
    """Two long requests, then one with a deadline of 15 steps, one sequence at a time."""
    long_ones = [make_request(max_new_tokens=10, ignore_eos=True, arrival_time=clock.now + i)
                 for i in range(2)]
    urgent = make_request(max_new_tokens=5, ignore_eos=True, arrival_time=clock.now + 2,
                          deadline=clock.now + 15)
    for request in long_ones + [urgent]:
        scheduler.add_request(request)
    while scheduler.has_work():
        run_step(scheduler)
        clock.now += 1  # each step takes a second of fake time
    return urgent


def test_edf_meets_a_deadline_that_fcfs_misses(clock):
    fcfs = _deadline_race(make_scheduler(max_num_seqs=1, policy="fcfs"), clock)
    assert fcfs.finish_reason is FinishReason.DEADLINE
    edf = _deadline_race(make_scheduler(max_num_seqs=1, policy="edf"), clock)
    assert edf.finish_reason is FinishReason.LENGTH
    assert len(edf.output_token_ids) == 5


def _tokens_by_tenant(policy):
    """Tenant a sends 10 requests for every one of tenant b; count the tokens each gets while
    both have work waiting."""
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, policy=policy)
    arrival = 0.0
    for _ in range(6):
        for tenant in ["a"] * 10 + ["b"]:
            arrival += 1
            scheduler.add_request(make_request(num_prompt_tokens=8, max_new_tokens=8,
                                               tenant=tenant, arrival_time=arrival))
    served = {"a": 0, "b": 0}
    while any(r.tenant == "b" for r in scheduler.policy):
        plan, _ = run_step(scheduler)
        for request, num_tokens in zip(plan.requests, plan.num_scheduled_tokens):
            served[request.tenant] += num_tokens
    return served


def test_fair_gives_two_tenants_about_half_each_at_ten_to_one_request_rates():
    fair = _tokens_by_tenant("fair")
    share_b = fair["b"] / (fair["a"] + fair["b"])
    assert 0.35 <= share_b <= 0.65, fair
    fcfs = _tokens_by_tenant("fcfs")
    assert fcfs["b"] / (fcfs["a"] + fcfs["b"]) < 0.2, fcfs


def test_sjf_runs_short_jobs_first_and_aging_still_finishes_the_long_one(clock):
    scheduler = make_scheduler(max_num_seqs=1, policy="sjf")
    long_job = make_request(max_new_tokens=60, ignore_eos=True, arrival_time=clock.now)
    scheduler.add_request(long_job)
    # 10 ms later each: aging (100 tokens/s by default) barely moves the order.
    shorts = [make_request(max_new_tokens=3, ignore_eos=True,
                           arrival_time=clock.now + 0.01 * (1 + i)) for i in range(5)]
    for request in shorts:
        scheduler.add_request(request)
    finished_order = []
    while scheduler.has_work():
        _, outputs = run_step(scheduler)
        finished_order += [r for r, o in outputs if o.finish_reason is not None]
        clock.now += 0.01
    assert finished_order[:5] == shorts
    assert finished_order[-1] is long_job and len(long_job.output_token_ids) == 60


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first():
    scheduler = make_scheduler(max_num_seqs=1, block_size=4, max_num_batched_tokens=64,
                               policy="lpm")
    shared = list(range(10, 42))  # 8 full blocks
    scheduler.add_request(make_request(prompt_token_ids=shared + [1], max_new_tokens=1))
    run_until_idle(scheduler)
    blocker = make_request(prompt_token_ids=range(100, 104), max_new_tokens=3, arrival_time=1)
    cold = make_request(prompt_token_ids=range(60, 90), max_new_tokens=1, arrival_time=2)
    warm = make_request(prompt_token_ids=shared + [7, 8], max_new_tokens=1, arrival_time=3)
    scheduler.add_request(blocker)
    run_step(scheduler)
    scheduler.add_request(cold)
    scheduler.add_request(warm)
    admitted = []
    while scheduler.has_work():
        plan, _ = run_step(scheduler)
        admitted += [s.token_ids for s in plan.new_sequences]
    assert admitted[0][:32] == shared  # warm overtook cold
    assert warm.num_cached_tokens == 32
