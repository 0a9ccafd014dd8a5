"""Times cython_ext.mapping.StepInputBuilder against the numpy original: µs per step. A plain script, not a test.

    cd /work/main && PYTHONPATH=protos:. .venv/bin/python bench/bench_mapping.py
"""
from __future__ import annotations

import time

import numpy as np

from cython_ext.mapping import StepInputBuilder
from tests.model_service.test_ms_mapping import make_workload, numpy_step_inputs

MAX_NUM_SLOTS = 512
MAX_MODEL_LEN = 8192
BLOCK_SIZE = 16


def per_call_us(fn, min_seconds: float = 0.5) -> float:
    """Best of 5 timed batches, each repeating fn until min_seconds / 5 has passed."""
    best = float("inf")
    for _ in range(5):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_seconds / 5:
            fn()
            calls += 1
        best = min(best, elapsed / calls)
    return best * 1e6


def decodes(num: int, rng: np.random.Generator, first_slot: int = 0) -> list[tuple[int, int, int, int]]:
    lens = rng.integers(64, 4096, size=num)
    return [(first_slot + i, int(k), int(k) - 1, 1) for i, k in enumerate(lens)]


def workloads():
    rng = np.random.default_rng(0)
    # A middle chunk (no sample) and a last chunk (samples), 512 tokens each.
    chunks = [(256, 4096, 1024, 512), (257, 1536, 1024, 512)]
    yield "256 decodes", decodes(256, rng)
    yield "256 decodes + 2 prefill chunks of 512", decodes(256, rng) + chunks
    yield "2 prefill chunks of 512", chunks
    yield "1 prefill of 4096", [(0, 4096, 0, 4096)]


def main() -> None:
    print(f"max_num_slots={MAX_NUM_SLOTS} max_model_len={MAX_MODEL_LEN} block_size={BLOCK_SIZE}; µs per step, best of 5")
    print(f"{'workload':<40} {'rows':>6} {'cython':>10} {'numpy':>10} {'speedup':>9}")
    for name, specs in workloads():
        w = make_workload(specs, max_num_slots=MAX_NUM_SLOTS, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
        c = w.slot_table
        builder = StepInputBuilder(4096, MAX_NUM_SLOTS, c.max_blocks_per_seq, BLOCK_SIZE)
        args = (c.tokens, c.block_table, c.num_computed, c.num_tokens, w.slots, w.num_scheduled)
        x = builder.build(*args)
        np.testing.assert_array_equal(x.slot_mapping, numpy_step_inputs(c, w.slots, w.num_scheduled, BLOCK_SIZE)["slot_mapping"])
        cy = per_call_us(lambda: builder.build(*args))
        ref = per_call_us(lambda: numpy_step_inputs(c, w.slots, w.num_scheduled, BLOCK_SIZE))
        print(f"{name:<40} {x.num_tokens:>6} {cy:>10.2f} {ref:>10.1f} {ref / cy:>8.1f}x")


if __name__ == "__main__":
    main()
