"""Host time of one scheduler step's plan: schedule() + to_pb(), Cython core against the oracle.

The load (DESIGN.md "Performance"): 256 running decodes, each with a 128-token prompt already
computed (greedy), and 1,000 waiting requests that cannot be admitted (max_num_seqs = 256). Each
step is timed from schedule() to the encoded ExecuteRequest; update() with a fake result (one
token per sequence) runs between steps and is timed separately. Prints best and median in µs and
the speedup, and writes them to bench/results/schedule.json. Rounds of both alternate; best and
median are over every timed step of every round.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_schedule.py [--steps 300] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos"), os.path.join(ROOT, "tests", "scheduler")]

from factories import make_request, make_tokenizer  # noqa: E402
from oracle_scheduler import OracleScheduler  # noqa: E402

from scheduler_service.config import SchedulerConfig  # noqa: E402
from scheduler_service.engine.client import EngineFacts  # noqa: E402
from scheduler_service.text.outputs import OutputProcessor  # noqa: E402
from scheduler_service.core.plan import StepResult, to_pb  # noqa: E402
from scheduler_service.core.scheduler import Scheduler  # noqa: E402

NUM_RUNNING = 256
NUM_WAITING = 1000
PROMPT_LEN = 128
BLOCK_SIZE = 16


def build(cls, num_steps: int):
    max_model_len = PROMPT_LEN + num_steps + 64
    facts = EngineFacts(
        model_name="bench", architecture="llama", dtype="float32", device="cpu",
        vocab_size=200, max_model_len=max_model_len, block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_RUNNING * (max_model_len // BLOCK_SIZE + 2) + 1,
        max_num_slots=NUM_RUNNING, eos_token_ids=frozenset({1}), bos_token_id=None,
        tokenizer_json="", chat_template="", special_tokens={})
    config = SchedulerConfig(max_num_seqs=NUM_RUNNING, max_num_batched_tokens=2048,
                             max_queue_len=NUM_WAITING + NUM_RUNNING).validate()
    scheduler = cls(config, facts, OutputProcessor(make_tokenizer(), facts.eos_token_ids,
                                                   max_model_len))
    for i in range(NUM_RUNNING):
        scheduler.add_request(make_request(
            prompt_token_ids=[2 + (i + j) % 150 for j in range(PROMPT_LEN)],
            max_new_tokens=num_steps + 32, ignore_eos=True, request_id=f"run{i}",
            arrival_time=float(i)))
    while len(scheduler.running) < NUM_RUNNING or any(
            r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
        plan = scheduler.schedule()
        scheduler.update(plan, result_for(plan))
    for i in range(NUM_WAITING):
        scheduler.add_request(make_request(num_prompt_tokens=PROMPT_LEN, request_id=f"wait{i}",
                                           arrival_time=1e6 + i))
    return scheduler


def result_for(plan) -> StepResult:
    counts, tokens = [], []
    for request, num_scheduled in zip(plan.requests, plan.num_scheduled_tokens):
        done = request.num_computed_tokens + num_scheduled >= request.num_tokens
        counts.append(1 if done else 0)
        if done:
            tokens.append(50)
    return StepResult(step_id=plan.step_id, num_sampled_tokens=counts, sampled_token_ids=tokens,
                      forward_ns=0, sample_ns=0, total_ns=0)


def measure(cls, num_steps: int, warmup: int) -> tuple[list[int], list[int]]:
    """(schedule + to_pb ns, update ns) per step, after `warmup` untimed steps."""
    scheduler = build(cls, num_steps + warmup)
    plan_ns, update_ns = [], []
    clock = time.perf_counter_ns
    for step in range(warmup + num_steps):
        t0 = clock()
        plan = scheduler.schedule()
        request = to_pb(plan)
        t1 = clock()
        assert len(plan.slots) == NUM_RUNNING and not plan.new_sequences, "not the bench load"
        assert request.plan.step_id == plan.step_id
        result = result_for(plan)
        t2 = clock()
        scheduler.update(plan, result)
        t3 = clock()
        if step >= warmup:
            plan_ns.append(t1 - t0)
            update_ns.append(t3 - t2)
    assert scheduler.num_waiting == NUM_WAITING
    return plan_ns, update_ns


def summary(samples: list[int]) -> dict:
    return {"best": min(samples) / 1e3, "median": statistics.median(samples) / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "schedule.json"))
    args = parser.parse_args()

    # One untimed round warms the interpreter and caches; then the two alternate, so that a
    # noisy neighbour or a frequency change hits both alike.
    measure(OracleScheduler, 20, 5)
    measure(Scheduler, 20, 5)
    samples = {Scheduler: ([], []), OracleScheduler: ([], [])}
    for _ in range(args.rounds):
        for cls in (Scheduler, OracleScheduler):
            plan_ns, update_ns = measure(cls, args.steps, args.warmup)
            samples[cls][0].extend(plan_ns)
            samples[cls][1].extend(update_ns)
    cython, oracle = ({"schedule_plan_us": summary(samples[cls][0]),
                       "update_us": summary(samples[cls][1]),
                       "steps": len(samples[cls][0])} for cls in (Scheduler, OracleScheduler))
    speedup = {k: oracle["schedule_plan_us"][k] / cython["schedule_plan_us"][k]
               for k in ("best", "median")}
    results = {
        "load": {"running_decodes": NUM_RUNNING, "waiting": NUM_WAITING,
                 "prompt_tokens": PROMPT_LEN, "block_size": BLOCK_SIZE},
        "cython": cython,
        "oracle": oracle,
        "speedup_schedule_plan": speedup,
        "goals": {"schedule_plan_under_100us": cython["schedule_plan_us"]["median"] < 100,
                  "speedup_at_least_20x": speedup["median"] >= 20},
        "machine": {"python": platform.python_version(), "processor": platform.processor(),
                    "machine": platform.machine(), "cpus": os.cpu_count()},
    }
    for name, r in (("cython", cython), ("oracle", oracle)):
        print(f"{name:7s} schedule+to_pb  best {r['schedule_plan_us']['best']:9.1f} µs  "
              f"median {r['schedule_plan_us']['median']:9.1f} µs   "
              f"update  best {r['update_us']['best']:8.1f} µs  "
              f"median {r['update_us']['median']:8.1f} µs")
    print(f"speedup schedule+to_pb: best {speedup['best']:.1f}x, median {speedup['median']:.1f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
