"""Golden parity: the Cython-backed Scheduler and the pure-Python oracle make the same decisions.

Each workload is generated at test time from a seeded generator (arrivals, prompt lengths, shared
prefixes, priorities, tenants, deadlines, aborts), replayed step by step through both schedulers
with the same fake results on the same fake clock; every plan is compared field by field (and as
protobuf bytes), then every output, and at the end the block pools (free queue order, ref counts,
prefix-cache map).
"""
from __future__ import annotations

import dataclasses
import random
import time
import zlib

import pytest
from factories import EOS, ShadowEngine, fake_result, make_request, make_tokenizer
from oracle_scheduler import OracleScheduler

from scheduler_service.config import SchedulerConfig
from scheduler_service.engine.client import EngineFacts
from scheduler_service.text.outputs import OutputProcessor
from scheduler_service.core.plan import to_pb
from scheduler_service.core.scheduler import Scheduler

MODES = ["interleaved", "prefill-first", "decode-priority"]


@dataclasses.dataclass
class Workload:
    """A seeded load: `arrivals[step]` lists request specs, `aborts[step]` indices of added ones."""

    scheduler: dict
    arrivals: dict[int, list[dict]]
    aborts: dict[int, list[int]]
    eos_every: int  # about one sampled token in eos_every is EOS (0: never)


def _specs(rng: random.Random, n: int, *, prompt=(1, 40), new=(1, 12), prefixes=(),
           salts=("",), deadline_every=0, start=0.0) -> list[dict]:
    specs = []
    for i in range(n):
        prompt_ids = [2 + rng.randrange(150) for _ in range(rng.randint(*prompt))]
        if prefixes and rng.random() < 0.7:
            prompt_ids = list(rng.choice(prefixes)) + prompt_ids
        spec = dict(prompt_token_ids=prompt_ids, max_new_tokens=rng.randint(*new),
                    priority=rng.randrange(4), tenant=rng.choice("abc"),
                    cache_salt=rng.choice(salts), arrival_time=start + i)
        if deadline_every and i % deadline_every == 0:
            spec["deadline"] = 1000.0 + rng.randint(1, 40)
        specs.append(spec)
    return specs


def _spread(rng: random.Random, specs: list[dict], num_steps: int) -> dict[int, list[dict]]:
    arrivals: dict[int, list[dict]] = {}
    for spec in specs:
        arrivals.setdefault(rng.randrange(num_steps), []).append(spec)
    return arrivals


def only_prefill(seed: int) -> Workload:
    rng = random.Random(seed)
    specs = _specs(rng, 24, prompt=(20, 90), new=(1, 1))
    return Workload(dict(num_blocks=128, max_num_batched_tokens=48, max_num_seqs=6),
                    _spread(rng, specs, 10), {}, 0)


def only_decode(seed: int) -> Workload:
    rng = random.Random(seed)
    specs = _specs(rng, 12, prompt=(1, 1), new=(10, 40))
    return Workload(dict(num_blocks=256, max_num_batched_tokens=64, max_num_seqs=16),
                    {0: specs}, {}, 0)


def mixed_chunked(seed: int) -> Workload:
    rng = random.Random(seed)
    specs = _specs(rng, 40, prompt=(1, 60), new=(1, 20), deadline_every=7)
    return Workload(dict(num_blocks=160, max_num_batched_tokens=24, max_num_seqs=8,
                         max_prefill_chunk=10, decode_reserve_tokens=4),
                    _spread(rng, specs, 40), {12: [3, 5], 25: [17]}, 23)


def near_capacity(seed: int) -> Workload:
    rng = random.Random(seed)
    specs = _specs(rng, 30, prompt=(4, 30), new=(8, 24))
    return Workload(dict(num_blocks=24, max_num_batched_tokens=32, max_num_seqs=8,
                         decode_reserve_tokens=2),
                    _spread(rng, specs, 20), {30: [2, 9, 11]}, 0)


def prefix_hits(seed: int) -> Workload:
    rng = random.Random(seed)
    prefixes = [[2 + rng.randrange(150) for _ in range(rng.randint(8, 24))] for _ in range(3)]
    specs = _specs(rng, 36, prompt=(1, 12), new=(1, 8), prefixes=prefixes,
                   salts=("", "", "tenant-x"))
    return Workload(dict(num_blocks=48, max_num_batched_tokens=40, max_num_seqs=6),
                    _spread(rng, specs, 30), {8: [1], 20: [4, 30]}, 11)


def parallel_samples(seed: int) -> Workload:
    """Requests with n > 1: forks, copy-on-write, samples waiting for room, aborts of groups."""
    rng = random.Random(seed)
    specs = _specs(rng, 16, prompt=(1, 30), new=(2, 14), deadline_every=5)
    for spec in specs:
        spec["n"] = rng.choice([1, 2, 3, 4])
    return Workload(dict(num_blocks=40, max_num_batched_tokens=32, max_num_seqs=6,
                         decode_reserve_tokens=2),
                    _spread(rng, specs, 20), {6: [1], 15: [4, 9]}, 13)


WORKLOADS = [only_prefill, only_decode, mixed_chunked, near_capacity, prefix_hits,
             parallel_samples]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _build(cls, *, num_blocks: int, block_size: int = 4, max_num_batched_tokens: int,
           max_num_seqs: int, max_num_slots: int = 16, max_model_len: int = 160, **config):
    config.setdefault("decode_reserve_tokens", 0)
    facts = EngineFacts(
        model_name="fake", architecture="llama", dtype="float32", device="cpu",
        vocab_size=200, max_model_len=max_model_len, block_size=block_size,
        num_kv_blocks=num_blocks, max_num_slots=max_num_slots, eos_token_ids=frozenset({EOS}),
        bos_token_id=None, tokenizer_json="", chat_template="", special_tokens={})
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs, **config).validate()
    return cls(config, facts, OutputProcessor(make_tokenizer(), facts.eos_token_ids,
                                              max_model_len))


def _next_token(eos_every: int):
    def next_token(request):
        key = zlib.crc32(f"{request.request_id}/{request.num_tokens}".encode())
        if eos_every and key % eos_every == 0:
            return EOS
        return 2 + key % 150
    return next_token


def _plan_fields(plan) -> dict:
    return dict(
        step_id=plan.step_id,
        new_sequences=[(s.slot, list(s.token_ids), s.sampling, s.num_computed_tokens)
                       for s in plan.new_sequences],
        requests=[r.request_id for r in plan.requests],
        slots=list(plan.slots), num_scheduled_tokens=list(plan.num_scheduled_tokens),
        num_new_blocks=list(plan.num_new_blocks), new_block_ids=list(plan.new_block_ids),
        finished_slots=list(plan.finished_slots), preempted_slots=list(plan.preempted_slots),
        aborted_slots=list(plan.aborted_slots), copy_src=list(plan.copy_src),
        copy_dst=list(plan.copy_dst))


def _outputs(outputs) -> list:
    return [(r.request_id, o.index, o.token_ids, o.text, o.finish_reason, o.stop_match)
            for r, o in outputs]


def _request_state(scheduler) -> list:
    return [(r.request_id, r.slot, r.num_computed_tokens, list(r.block_ids), r.status,
             r.num_preemptions, r.num_cached_tokens) for r in scheduler.running]


def _pool_state(pool) -> dict:
    return dict(num_free=pool.num_free, num_cached=pool.num_cached, free_queue=pool.free_queue(),
                refs=[pool.ref_count(b) for b in range(pool.num_blocks)])


def replay(workload: Workload, policy: str, mode: str, clock: FakeClock) -> int:
    """Runs the workload through both schedulers in lockstep; returns the number of steps."""
    native = _build(Scheduler, policy=policy, chunking_mode=mode, **workload.scheduler)
    oracle = _build(OracleScheduler, policy=policy, chunking_mode=mode, **workload.scheduler)
    shadow = ShadowEngine(native.kv.block_size)
    next_token = _next_token(workload.eos_every)
    added: list[str] = []
    last_arrival = max(workload.arrivals, default=0)
    step = 0
    while step <= last_arrival or native.has_work() or oracle.has_work():
        assert step < 3000, "the load did not drain"
        for index, spec in enumerate(workload.arrivals.get(step, [])):
            request_id = f"s{step}-{index}"
            added.append(request_id)
            for scheduler in (native, oracle):
                scheduler.add_request(make_request(request_id=request_id, **spec))
        for index in workload.aborts.get(step, []):
            if index < len(added):
                assert (native.abort_request(added[index])
                        == oracle.abort_request(added[index]))
        native_plan, oracle_plan = native.schedule(), oracle.schedule()
        assert _plan_fields(native_plan) == _plan_fields(oracle_plan), f"step {step}"
        assert (to_pb(native_plan).SerializeToString()
                == to_pb(oracle_plan).SerializeToString()), f"step {step}"
        shadow.apply(native_plan)
        native_out = native.take_early_outputs() + native.update(
            native_plan, fake_result(native_plan, next_token))
        oracle_out = oracle.take_early_outputs() + oracle.update(
            oracle_plan, fake_result(oracle_plan, next_token))
        assert _outputs(native_out) == _outputs(oracle_out), f"step {step}"
        assert _request_state(native) == _request_state(oracle), f"step {step}"
        assert native.kv.num_free_blocks == oracle.kv.num_free_blocks, f"step {step}"
        clock.now += 1.0
        step += 1
    assert _pool_state(native.kv.pool) == _pool_state(oracle.kv.pool)
    for block_hash, block in oracle.kv.pool.hash_to_block.items():
        assert native.kv.pool.lookup(block_hash) == block
    assert native.kv.num_free_blocks == native.kv.num_usable_blocks
    return step


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(time, "monotonic", fake)
    return fake


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.__name__)
@pytest.mark.parametrize("seed", [0, 1])
def test_golden_parity(workload, policy, mode, seed, clock):
    assert replay(workload(seed), policy, mode, clock) > 1


@pytest.mark.parametrize("policy", ["sjf", "edf", "fair", "lpm"])
@pytest.mark.parametrize("workload", [mixed_chunked, near_capacity, prefix_hits,
                                      parallel_samples], ids=lambda w: w.__name__)
def test_golden_parity_other_policies(workload, policy, clock):
    replay(workload(7), policy, "interleaved", clock)


def test_prefill_first_preemption_does_not_schedule_a_decode_twice(clock):
    """A decode preempted by a prompt chunk and re-admitted in the same step is scheduled once
    (the one place the oracle differs from the Python scheduler it was copied from)."""
    rng = random.Random(3)
    specs = _specs(rng, 20, prompt=(10, 40), new=(10, 30))
    workload = Workload(dict(num_blocks=20, max_num_batched_tokens=40, max_num_seqs=6),
                        _spread(rng, specs, 15), {}, 0)
    replay(workload, "fcfs", "prefill-first", clock)
