"""Properties of the step rule over random arrivals, aborts and stops, under every policy."""
import collections

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from factories import EOS, make_request, make_scheduler, run_step

from scheduler_service.core.request import FinishReason, RequestStatus

POLICIES = ["fcfs", "priority", "sjf", "edf", "fair", "lpm"]
MODES = ["interleaved", "prefill-first", "decode-priority"]

request_specs = st.fixed_dictionaries({
    "num_prompt_tokens": st.integers(1, 40),
    "max_new_tokens": st.integers(1, 12),
    "priority": st.integers(0, 3),
    "tenant": st.sampled_from(["a", "b", "c"]),
    "shared_prefix": st.booleans(),
})
events = st.lists(st.one_of(
    st.tuples(st.just("add"), request_specs),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(0, 9)),
    st.tuples(st.just("check"), st.just(0)),
), min_size=5, max_size=60)


def _check_invariants(scheduler, plan):
    assert sum(plan.num_scheduled_tokens) <= scheduler.token_budget
    assert len(plan.slots) <= scheduler.max_num_seqs
    assert len(set(plan.slots)) == len(plan.slots)
    holders = collections.Counter(b for r in scheduler.running for b in r.block_ids)
    pool = scheduler.kv.pool
    for block, count in holders.items():
        assert pool.ref_count(block) == count  # never negative, never leaked
    assert pool.num_free == pool.num_usable - len(holders)


def _check_waiting_tokens(scheduler):
    """The queue's token count is what walking the waiting requests gives. It is kept up
    between reads, so it is read only at the history's "check" events: a read after every
    event would refresh it each time."""
    walked = sum(r.num_tokens_to_compute for r in scheduler.requests.values()
                 if r.status is RequestStatus.WAITING)
    assert scheduler.num_waiting_tokens == walked


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), mode=st.sampled_from(MODES), events=events,
       eos_every=st.integers(2, 30))
def test_budget_blocks_and_completion_hold_for_any_history(policy, mode, events, eos_every):
    scheduler = make_scheduler(num_blocks=20, block_size=4, max_num_batched_tokens=16,
                               max_num_seqs=4, policy=policy, chunking_mode=mode,
                               decode_reserve_tokens=4)
    shared = list(range(60, 76))
    added = []
    step_count = [0]

    def next_token(request):
        step_count[0] += 1
        return EOS if step_count[0] % eos_every == 0 else 50

    def step():
        plan, _ = run_step(scheduler, next_token)
        _check_invariants(scheduler, plan)

    for kind, value in events:
        if kind == "add":
            spec = dict(value)
            prompt = list(range(2, 2 + spec.pop("num_prompt_tokens")))
            if spec.pop("shared_prefix"):
                prompt = shared + prompt
            request = make_request(prompt_token_ids=prompt, arrival_time=len(added), **spec)
            scheduler.add_request(request)
            added.append(request)
        elif kind == "abort" and added:
            scheduler.abort_request(added[value % len(added)].request_id)
        elif kind == "check":
            _check_waiting_tokens(scheduler)
        elif kind == "step":
            for _ in range(value):
                step()

    for _ in range(2000):  # no starvation: a finite load always drains
        if not scheduler.has_work():
            break
        step()
    assert not scheduler.has_work()
    for request in added:
        assert request.is_finished
        if request.finish_reason is not FinishReason.CANCELLED:
            assert request.finish_reason in (FinishReason.EOS, FinishReason.LENGTH)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    assert scheduler.slots.num_free == scheduler.facts.max_num_slots
