"""Times cython_ext.block_pool against the pure-Python oracle: µs per op. A plain script, not a test.

    cd /work/main && PYTHONPATH=protos:. .venv/bin/python bench/bench_block_pool.py
"""
from __future__ import annotations

import random
import time

from cython_ext.block_pool import BlockPool
from tests.scheduler.block_pool_oracle import OracleBlockPool

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


def row(name: str, fn, *args) -> None:
    c, p = fn(BlockPool, *args), fn(OracleBlockPool, *args)
    print(f"{name:<52} {c:>10.3f} {p:>12.2f} {p / c:>9.0f}x")


def main() -> None:
    print(f"num_blocks={NUM_BLOCKS} block_size={BLOCK_SIZE}; µs per op, best of 5")
    print(f"{'op':<52} {'cython':>10} {'oracle':>12} {'speedup':>10}")
    for n in (1, 16, 256):
        row(f"allocate({n}) + free (per cycle)", bench_alloc_free, n)
    row("decode step, 256 seqs x allocate(1)+free (per seq)", bench_decode_step, 256)
    for prompt_len, frac in ((512, 1.0), (2048, 1.0), (2048, 0.5), (2048, 0.0)):
        row(f"match_prefix {prompt_len} tokens, {int(frac * 100)}% cached", bench_match_prefix, prompt_len, frac)


if __name__ == "__main__":
    main()
