"""LoRA adapters in the scheduler (core/lora_admission.py, core/loras.py): at most max_loras
distinct adapters per step under every policy, skipping and not blocking, no starvation of a
rare adapter, the prefix cache keyed by adapter, residency (LRU eviction of idle adapters only),
and the adapter kept across preemption.

The model service is the fake one of factories.py; adapter loads complete at once
(`complete_loads`), which is what the engine loop does with LoadAdapter replies.
"""

from __future__ import annotations

import random

import pytest

from scheduler_service.core.loras import LoraCapacity
from scheduler_service.core.request import RequestStatus
from tests.scheduler.factories import make_facts, make_request, make_scheduler, run_step

POLICIES = ("fcfs", "priority", "edf", "fair", "lpm", "sjf")
IDS = {name: i + 1 for i, name in enumerate("ABCDEFGH")}


def lora_scheduler(max_loras=2, max_cpu_loras=4, num_blocks=256, num_swap_blocks=0, **config):
    capacity = LoraCapacity(max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_cpu_loras)
    facts = make_facts(
        num_blocks=num_blocks, max_num_slots=32, lora=capacity, num_swap_blocks=num_swap_blocks
    )
    config.setdefault("max_num_seqs", 16)
    config.setdefault("max_num_batched_tokens", 64)
    return make_scheduler(facts=facts, **config)


def lora_request(name, **fields):
    return make_request(lora_name=name, lora_id=IDS[name] if name else 0, **fields)


class Loads:
    """Completes the scheduler's adapter loads at once and records evictions, checking that
    no adapter a running sequence uses is ever evicted."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.evicted: list[str] = []
        self.loaded: list[str] = []

    def complete(self):
        loras = self.scheduler.loras
        for name, lora_id, evicted in loras.start_loads():
            if evicted is not None:
                users = [r for r in self.scheduler.running if r.lora_name == evicted[0]]
                assert not users, f"evicted {evicted[0]} while {len(users)} sequences run with it"
                self.evicted.append(evicted[0])
            assert loras.loaded(name, lora_id, loras.epoch)
            self.loaded.append(name)


def step(scheduler, loads, max_loras, next_token=lambda request: 50):
    """One step; checks the plan against the adapter rules; returns the plan."""
    plan, _ = run_step(scheduler, next_token)
    names = {r.lora_name for r in plan.requests if r.lora_name}
    assert len(names) <= max_loras, f"step {plan.step_id} ran adapters {sorted(names)}"
    turns = scheduler.loras.turns
    if turns.on:  # parking: sequences of adapters out of turn hold slots, the plan skips them
        assert len(turns.active) <= max_loras and names <= set(turns.active)
    else:
        running = {r.lora_name for r in scheduler.running if r.lora_name}
        assert len(running) <= max_loras
    by_slot = dict(zip(plan.slots, plan.requests))
    for seq in plan.new_sequences:
        assert seq.lora_id == by_slot[seq.slot].lora_id
    loads.complete()
    return plan


def run(scheduler, max_loras, max_steps=5000):
    loads = Loads(scheduler)
    steps = 0
    while scheduler.has_work():
        step(scheduler, loads, max_loras)
        steps += 1
        assert steps < max_steps, "the scheduler did not drain"
    return loads


def test_a_request_whose_adapter_has_no_place_is_skipped_not_blocking():
    scheduler = lora_scheduler(max_loras=1)
    loads = Loads(scheduler)
    scheduler.add_request(lora_request("A", max_new_tokens=6))
    step(scheduler, loads, 1)  # A's adapter loads
    step(scheduler, loads, 1)  # A runs
    blocked = lora_request("B", max_new_tokens=2)
    base = lora_request("", max_new_tokens=2)
    same = lora_request("A", max_new_tokens=2)
    for request in (blocked, base, same):
        scheduler.add_request(request)
    step(scheduler, loads, 1)
    assert blocked.status is RequestStatus.WAITING and blocked.lora_skips == 1
    assert base.status is RequestStatus.RUNNING and same.status is RequestStatus.RUNNING
    # Its place is kept: once A's requests end, B goes before a later arrival of C.
    later = lora_request("C", max_new_tokens=2)
    scheduler.add_request(later)
    while blocked.status is RequestStatus.WAITING:
        step(scheduler, loads, 1)
    assert later.status is RequestStatus.WAITING


@pytest.mark.parametrize("policy", POLICIES)
def test_max_loras_per_step_holds_for_every_policy(policy):
    rng = random.Random(7)
    scheduler = lora_scheduler(max_loras=2, max_cpu_loras=3, policy=policy)
    for i in range(60):
        name = rng.choice(["", "A", "B", "C", "D", "E"])
        scheduler.add_request(
            lora_request(
                name,
                num_prompt_tokens=rng.randint(3, 20),
                max_new_tokens=rng.randint(1, 8),
                priority=rng.randint(0, 2),
                tenant=rng.choice(["t1", "t2"]),
                deadline=None if i % 3 else 1e12 + i,
            )
        )
    run(scheduler, max_loras=2)
    assert not scheduler.requests and scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    assert not scheduler.loras.running and not scheduler.loras.in_flight


def _stream(lora_max_skipped_steps, max_steps=300, rotate=0, park=0):
    """Two popular adapters with a new request each every step, a rare one arriving at step 3;
    returns the step the rare one started at (None: never within max_steps)."""
    scheduler = lora_scheduler(
        max_loras=2,
        lora_max_skipped_steps=lora_max_skipped_steps,
        lora_rotate_after_steps=rotate,
        lora_park_after_steps=park,
    )
    loads = Loads(scheduler)
    rare = lora_request("C", max_new_tokens=2)
    for number in range(max_steps):
        for name in ("A", "B"):
            scheduler.add_request(lora_request(name, num_prompt_tokens=4, max_new_tokens=4))
        if number == 3:
            scheduler.add_request(rare)
        step(scheduler, loads, 2)
        if rare.status is not RequestStatus.WAITING:
            return number
    return None


def test_a_rare_adapter_is_not_starved_by_a_steady_stream_of_popular_ones():
    started = _stream(lora_max_skipped_steps=8)
    assert started is not None and started < 3 + 8 + 20
    # Without the rule (a bound it never reaches) the popular adapters keep every place.
    assert _stream(lora_max_skipped_steps=10_000) is None
    # Rotation alone lets it in too, after about a quantum and one request's lifetime.
    started = _stream(lora_max_skipped_steps=10_000, rotate=4)
    assert started is not None and started < 3 + 4 + 20
    # Parking (the default) gives it the next turn: the popular ones held theirs long enough.
    started = _stream(lora_max_skipped_steps=10_000, park=2)
    assert started is not None and started <= 3 + 2


def test_the_prefix_cache_is_keyed_by_adapter():
    scheduler = lora_scheduler(max_loras=2)
    prompt = list(range(2, 30))
    first = lora_request("A", prompt_token_ids=prompt, max_new_tokens=1)
    scheduler.add_request(first)
    run(scheduler, max_loras=2)
    again = lora_request("A", prompt_token_ids=prompt)
    other = lora_request("B", prompt_token_ids=prompt)
    base = lora_request("", prompt_token_ids=prompt)
    assert scheduler.kv.num_cached_prefix_tokens(again) > 0
    assert scheduler.kv.num_cached_prefix_tokens(other) == 0
    assert scheduler.kv.num_cached_prefix_tokens(base) == 0
    # The same name under a new id (unloaded, loaded again) is a new adapter.
    reloaded = make_request(prompt_token_ids=prompt, lora_name="A", lora_id=99)
    assert scheduler.kv.num_cached_prefix_tokens(reloaded) == 0


def test_eviction_takes_the_least_recently_used_idle_adapter_never_one_in_use():
    scheduler = lora_scheduler(max_loras=1, max_cpu_loras=2)
    loads = Loads(scheduler)
    for name in ("A", "B", "C", "A", "D"):
        scheduler.add_request(lora_request(name, max_new_tokens=3))
    while scheduler.has_work():
        step(scheduler, loads, 1)  # Loads.complete checks no victim runs
    # A, B loaded; C evicts A (the least recently used, idle and unused: the second A request
    # is still waiting, so B, unused, goes first); and so on.
    assert loads.loaded[:2] == ["A", "B"]
    assert len(loads.evicted) >= 2
    assert scheduler.loras.resident.keys() <= {"A", "B", "C", "D"}
    assert len(scheduler.loras.resident) <= 2


def test_an_adapter_only_a_running_sequence_uses_is_never_a_victim():
    scheduler = lora_scheduler(max_loras=2, max_cpu_loras=2)
    loads = Loads(scheduler)
    scheduler.add_request(lora_request("A", max_new_tokens=50))
    scheduler.add_request(lora_request("B", max_new_tokens=50))
    for _ in range(3):
        step(scheduler, loads, 2)
    scheduler.add_request(lora_request("C", max_new_tokens=1))
    for _ in range(5):
        step(scheduler, loads, 2)
    assert scheduler.loras.victim() is None
    assert "C" not in scheduler.loras.resident and not loads.evicted


def test_a_preempted_sequence_comes_back_with_its_adapter():
    scheduler = lora_scheduler(max_loras=2, num_blocks=12)
    loads = Loads(scheduler)
    requests = [lora_request(n, num_prompt_tokens=8, max_new_tokens=12) for n in "AABB"]
    for request in requests:
        scheduler.add_request(request)
    registered: dict[int, list[int]] = {}
    while scheduler.has_work():
        plan = step(scheduler, loads, 2)  # checks each NewSequence's lora_id
        for seq in plan.new_sequences:
            registered.setdefault(seq.lora_id, []).append(seq.slot)
    assert scheduler.num_preemptions_total > 0
    assert set(registered) == {IDS["A"], IDS["B"]}


def test_a_restart_forgets_residency_and_loads_again():
    scheduler = lora_scheduler(max_loras=2)
    loads = Loads(scheduler)
    scheduler.add_request(lora_request("A", max_new_tokens=20))
    for _ in range(3):
        step(scheduler, loads, 2)
    epoch = scheduler.loras.epoch
    scheduler.reset_engine(scheduler.facts)
    del scheduler.shadow_engine  # a new model service: no slot registered
    assert not scheduler.loras.resident and scheduler.loras.epoch == epoch + 1
    assert not scheduler.loras.loaded("A", IDS["A"], epoch)  # a load from before the restart
    while scheduler.has_work():
        step(scheduler, loads, 2)
    assert loads.loaded.count("A") == 2


def test_kv_events_name_the_adapter_of_its_blocks(tmp_path):
    import msgpack

    from scheduler_service.engine.kv_events import KVEventPublisher, KVEventStream, parse_config

    config = parse_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "ipc://{tmp_path}/kv-lora"}}'
    )
    publisher = KVEventPublisher(config, start=False)  # batches stay in its queue
    try:
        scheduler = lora_scheduler(max_loras=2)
        scheduler.kv.enable_events()
        stream = KVEventStream(publisher, scheduler.kv.block_size)
        stream.lora_roots = scheduler.kv.lora_roots
        prompt = list(range(2, 14))  # three full blocks of 4
        for name in ("A", ""):
            scheduler.add_request(lora_request(name, prompt_token_ids=prompt, max_new_tokens=1))
        run(scheduler, max_loras=2)
        stream.on_step(scheduler.kv.pool)
        _, events, _ = publisher._queue.get_nowait()
        stored = [e for e in msgpack.unpackb(msgpack.packb(events)) if e[0] == "BlockStored"]
        adapted = [e for e in stored if e[5] is not None]
        assert len(adapted) == 3 and len(stored) == 6
        assert all(e[5] == IDS["A"] and e[7] == "A" for e in adapted)
        assert all(len(e) == 7 for e in stored if e[5] is None)  # base blocks as before
    finally:
        publisher.close()


def test_the_lora_affinity_scorer_prefers_the_replica_running_the_adapter():
    import types

    from scheduler_service.engine.scorers import builtin

    running, loaded, full, empty = (lora_scheduler(max_loras=1) for _ in range(4))
    running.loras.running["A"] = 1
    running.loras.resident["A"] = IDS["A"]
    loaded.loras.resident["A"] = IDS["A"]
    full.loras.resident["A"] = IDS["A"]
    full.loras.running["B"] = 1
    replicas = [
        types.SimpleNamespace(name=str(i), scheduler=s)
        for i, s in enumerate((running, loaded, full, empty))
    ]
    scorer = builtin.LoraAffinity()
    assert scorer.score(lora_request("A"), replicas) == [1.0, 0.75, 0.25, 0.5]
    assert scorer.score(lora_request(""), replicas) == [0.0] * 4


def test_a_skipped_request_takes_none_of_the_chunked_prefill_budget():
    scheduler = lora_scheduler(max_loras=1, max_num_batched_tokens=32)
    loads = Loads(scheduler)
    scheduler.add_request(lora_request("A", num_prompt_tokens=4, max_new_tokens=20))
    step(scheduler, loads, 1)
    step(scheduler, loads, 1)  # A decodes: one token a step
    blocked = lora_request("B", num_prompt_tokens=40)
    base = lora_request("", num_prompt_tokens=60)
    scheduler.add_request(blocked)
    scheduler.add_request(base)
    plan = step(scheduler, loads, 1)
    scheduled = dict(zip((r.request_id for r in plan.requests), plan.num_scheduled_tokens))
    assert blocked.request_id not in scheduled
    assert scheduled[base.request_id] == 32 - 1  # the whole budget left after A's decode
    assert sum(plan.num_scheduled_tokens) == 32
