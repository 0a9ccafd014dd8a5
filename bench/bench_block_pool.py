"""Times cython_ext.block_pool against the pure-Python oracle: µs per op. A plain script, not a test.

Then the prefix cache's cost where it is paid: SHA-256 per block, and a scheduler (Cython core,
no model) admitting 16 prompts of 4,096 tokens that share 3,584 (224 cached blocks each) while
256 decodes run: schedule() + to_pb() per step, against the same scheduler's decode-only steps.

    cd /work/main && PYTHONPATH=protos:. .venv/bin/python bench/bench_block_pool.py [--admission]

--admission runs the admission case alone. PLANSERVE_SHA256=portable times the portable SHA-256.
"""
from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "scheduler"))

from cython_ext import block_pool  # noqa: E402
from cython_ext.block_pool import BlockPool  # noqa: E402
from tests.scheduler.block_pool_oracle import OracleBlockPool  # noqa: E402

NUM_BLOCKS = 4096
BLOCK_SIZE = 16


def per_op_us(fn, ops_per_call: int, min_seconds: float = 0.3) -> float:
    """Best of 5 timed batches, each repeating fn until min_seconds / 5 has passed."""
    best = float("inf")
    for _ in range(5):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_seconds / 5:
            fn()
            calls += 1
        best = min(best, elapsed / (calls * ops_per_call))
    return best * 1e6


def bench_alloc_free(pool_cls, n: int) -> float:
    pool = pool_cls(NUM_BLOCKS)

    def cycle():
        pool.free(pool.allocate(n))

    return per_op_us(cycle, 1)


def bench_decode_step(pool_cls, batch: int) -> float:
    # One decode step's block work: each of `batch` running sequences grows by one block, then the
    # step's finished sequences give theirs back. Per op = per sequence.
    pool = pool_cls(NUM_BLOCKS)

    def step():
        blocks = [pool.allocate(1)[0] for _ in range(batch)]
        pool.free(blocks)

    return per_op_us(step, batch)


def bench_match_prefix(pool_cls, prompt_len: int, hit_frac: float) -> float:
    rng = random.Random(0)
    pool = pool_cls(NUM_BLOCKS)
    prompt = [rng.randrange(32000) for _ in range(prompt_len)]
    num_full = prompt_len // BLOCK_SIZE
    hashes = pool.block_hashes(prompt, BLOCK_SIZE)
    blocks = pool.allocate(int(num_full * hit_frac))
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    expected = len(blocks)
    assert len(pool.match_prefix(prompt, BLOCK_SIZE)) == expected
    return per_op_us(lambda: pool.match_prefix(prompt, BLOCK_SIZE), 1)


def bench_hash_per_block(block_size: int) -> float:
    # block_hashes over a 2,048-token prompt, per block: the SHA-256 plus the list conversion.
    pool = BlockPool(4)
    prompt = [random.Random(1).randrange(32000) for _ in range(2048)]
    return per_op_us(lambda: pool.block_hashes(prompt, block_size), 2048 // block_size)


def bench_compression() -> float:
    # One SHA-256 compression (64 bytes), streamed over 3,000 blocks: the path's raw speed.
    data = bytes(64 * 3000)
    return per_op_us(lambda: block_pool.sha256(data), 3000)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def row(name: str, fn, *args) -> None:
    c, p = fn(BlockPool, *args), fn(OracleBlockPool, *args)
    print(f"{name:<52} {c:>10.3f} {p:>12.2f} {p / c:>9.0f}x")


ADMIT_RUNNING, ADMIT_PROMPTS, ADMIT_LEN, ADMIT_SHARED = 256, 16, 4096, 3584


def bench_admission(rounds: int = 1) -> dict:
    """Per-step host time (schedule + to_pb, µs) of decode-only steps at 256 running and of the
    steps that admit 16 shared-prefix prompts (their prefix hits: match_prefix + admit + cache).
    rounds > 1 repeats the whole case on a fresh scheduler and pools the steps (a shared, noisy
    machine: 5 admission steps a round make a jumpy median)."""
    runs = [_admission_once() for _ in range(rounds)]
    pooled = {key: [v for run in runs for v in run[key]] for key in runs[0]}
    us = lambda ns: round(ns / 1e3, 1)  # noqa: E731
    return {"rounds": rounds,
            "decode_256_median_us": us(statistics.median(pooled["decode"])),
            "admission_steps": len(pooled["admitting"]),
            "prompts_admitted_per_step": pooled["per_step"],
            "admission_step_median_us": us(statistics.median(pooled["admitting"])),
            "admission_step_max_us": us(max(pooled["admitting"])),
            "of_which_to_pb_median_us": us(statistics.median(pooled["encoding"])),
            "decode_after_admission_median_us": us(statistics.median(pooled["after"])),
            "cached_tokens_per_prompt": pooled["hits"][0]}


def _admission_once() -> dict:
    from factories import make_request, make_tokenizer

    from scheduler_service.config import SchedulerConfig
    from scheduler_service.engine.client import EngineFacts
    from scheduler_service.text.outputs import OutputProcessor
    from scheduler_service.core.plan import StepResult, to_pb
    from scheduler_service.core.scheduler import Scheduler

    max_len = ADMIT_LEN + 256
    slots = ADMIT_RUNNING + ADMIT_PROMPTS + 1
    facts = EngineFacts(
        model_name="bench", architecture="llama", dtype="float32", device="cpu", vocab_size=32000,
        max_model_len=max_len, block_size=BLOCK_SIZE,
        num_kv_blocks=ADMIT_RUNNING * 24 + (ADMIT_PROMPTS + 1) * (max_len // BLOCK_SIZE) + 1,
        max_num_slots=slots, eos_token_ids=frozenset({1}), bos_token_id=None,
        tokenizer_json="", chat_template="", special_tokens={})
    config = SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=2048,
                             max_queue_len=1024).validate()
    sched = Scheduler(config, facts, OutputProcessor(make_tokenizer(), facts.eos_token_ids, max_len))

    encode_ns = [0]

    def step() -> tuple[int, object]:
        t0 = time.perf_counter_ns()
        plan = sched.schedule()
        t1 = time.perf_counter_ns()
        to_pb(plan)
        elapsed = time.perf_counter_ns() - t0
        encode_ns[0] = elapsed - (t1 - t0)
        counts, tokens = [], []
        for request, n in zip(plan.requests, plan.num_scheduled_tokens):
            done = request.num_computed_tokens + n >= request.num_tokens
            counts.append(1 if done else 0)
            tokens += [50] if done else []
        sched.update(plan, StepResult(step_id=plan.step_id, num_sampled_tokens=counts,
                                      sampled_token_ids=tokens, forward_ns=0, sample_ns=0,
                                      total_ns=0))
        return elapsed, plan

    rng = random.Random(19)
    for i in range(ADMIT_RUNNING):
        sched.add_request(make_request(prompt_token_ids=[2 + (i + j) % 150 for j in range(128)],
                                       max_new_tokens=2000, ignore_eos=True, request_id=f"run{i}"))
    shared = [rng.randrange(2, 32000) for _ in range(ADMIT_SHARED)]
    # The first prompt with the shared prefix computes it; its full blocks enter the cache.
    sched.add_request(make_request(prompt_token_ids=shared + [7] * (ADMIT_LEN - ADMIT_SHARED),
                                   max_new_tokens=2000, ignore_eos=True, request_id="warm"))
    while len(sched.running) < ADMIT_RUNNING + 1 or any(
            r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        step()
    decode = [step()[0] for _ in range(60)][10:]
    for i in range(ADMIT_PROMPTS):
        tail = [rng.randrange(2, 32000) for _ in range(ADMIT_LEN - ADMIT_SHARED)]
        sched.add_request(make_request(prompt_token_ids=shared + tail, max_new_tokens=2000,
                                       ignore_eos=True, request_id=f"new{i}"))
    admitting, encoding, per_step, hits = [], [], [], []
    while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        elapsed, plan = step()
        if plan.new_sequences:
            admitting.append(elapsed)
            encoding.append(encode_ns[0])
            per_step.append(len(plan.new_sequences))
    hits = [r.num_cached_tokens for r in sched.running if r.request_id.startswith("new")]
    assert len(hits) == ADMIT_PROMPTS and all(h == ADMIT_SHARED for h in hits), hits
    after = [step()[0] for _ in range(60)][10:]
    return {"decode": decode, "admitting": admitting, "encoding": encoding, "per_step": per_step,
            "after": after, "hits": hits}


def main() -> None:
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"SHA-256 path {block_pool.sha256_impl()} (of {', '.join(block_pool.sha256_impls())})")
    if "--admission" in sys.argv[1:]:  # the admission case alone, 3 rounds (a before/after)
        for key, value in bench_admission(rounds=3).items():
            print(f"  {key:<36} {value}")
        return
    print(f"num_blocks={NUM_BLOCKS} block_size={BLOCK_SIZE}; µs per op, best of 5")
    print(f"{'op':<52} {'cython':>10} {'oracle':>12} {'speedup':>10}")
    for n in (1, 16, 256):
        row(f"allocate({n}) + free (per cycle)", bench_alloc_free, n)
    row("decode step, 256 seqs x allocate(1)+free (per seq)", bench_decode_step, 256)
    for prompt_len, frac in ((512, 1.0), (2048, 1.0), (2048, 0.5), (2048, 0.0)):
        row(f"match_prefix {prompt_len} tokens, {int(frac * 100)}% cached", bench_match_prefix, prompt_len, frac)
    chosen = block_pool.sha256_impl()
    for impl in block_pool.sha256_impls():
        block_pool.set_sha256_impl(impl)
        print(f"SHA-256 {impl}: {bench_compression():.4f} µs per 64-byte compression; block hash "
              + ", ".join(f"block_size={bs} {bench_hash_per_block(bs):.3f}" for bs in (16, 32))
              + " µs per block (best of 5)")
    block_pool.set_sha256_impl(chosen)
    print(f"admission of {ADMIT_PROMPTS} x {ADMIT_LEN}-token prompts sharing {ADMIT_SHARED}, "
          f"{ADMIT_RUNNING} decodes running, schedule + to_pb per step:")
    for key, value in bench_admission(rounds=3).items():
        print(f"  {key:<36} {value}")


if __name__ == "__main__":
    main()
