"""Preemption by swap vs by recompute on SmolLM2-135M: the same greedy workload against a model
service whose KV cache is too small for it, once with --swap-space (preemption mode auto: swap)
and once without (recompute), plus once with room for everyone (no preemption: the reference
tokens). A plain script, not a test; a few minutes on 2 CPU cores.

    cd /work/main && PYTHONPATH=protos:. .venv/bin/python bench/bench_swap.py [DTYPE]   # float32

Reports per run: wall time, tokens the model computed (prompt + decode positions, summed over the
plans: recomputation shows up here), preemptions, swap-outs and blocks swapped, and whether the
tokens equal the reference run's (float32: they do; in bfloat16 a different batch composition
rounds differently and near-ties flip). Writes bench/results/swap.json.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from api import complete, greedy_ids_request, stub_for  # noqa: E402
from conftest import EngineProcess, start_scheduler  # noqa: E402

NUM_REQUESTS = 8
PROMPT_TOKENS = 200
NEW_TOKENS = 64
BLOCK = 16
# 8 x (200 + 64) tokens = 8 x 17 blocks = 136 blocks; 64 usable blocks force preemption.
SMALL_KV_BLOCKS = 65
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "swap.json")


async def _run(dtype: str, num_kv_blocks: int, swap_space: int) -> dict:
    args = ["--model", "smollm2", "--dtype", dtype, "--num-kv-blocks", str(num_kv_blocks)]
    if swap_space:
        args += ["--swap-space", str(swap_space)]
    engine = EngineProcess(*args)
    try:
        server = await start_scheduler(engine.address, max_num_batched_tokens=256, max_num_seqs=NUM_REQUESTS,
                                       decode_reserve_tokens=0)
        scheduler = server.loop.scheduler
        computed = [0]
        schedule = scheduler.schedule

        def counting_schedule():
            plan = schedule()
            computed[0] += plan.total_scheduled_tokens
            return plan

        scheduler.schedule = counting_schedule
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1000, 40000, size=PROMPT_TOKENS).tolist() for _ in range(NUM_REQUESTS)]
        stub = stub_for(server)
        start = time.perf_counter()
        done = await asyncio.gather(*(complete(stub, greedy_ids_request(p, NEW_TOKENS)) for p in prompts))
        wall_s = time.perf_counter() - start
        result = dict(
            num_kv_blocks=num_kv_blocks, num_swap_blocks=scheduler.swap.num_blocks, wall_s=round(wall_s, 2),
            tokens_computed=computed[0], preemptions=scheduler.num_preemptions_total,
            swap_outs=scheduler.swap.num_swap_outs, blocks_swapped_out=scheduler.swap.num_blocks_swapped_out,
            tokens=[c.token_ids for c in done])
        await server.stop(grace_s=1)
        return result
    finally:
        engine.stop()


async def main(dtype: str) -> None:
    block_bytes = 2 * 30 * BLOCK * 3 * 64 * (4 if dtype == "float32" else 2)
    runs = {
        "roomy": await _run(dtype, 512, 0),
        "recompute": await _run(dtype, SMALL_KV_BLOCKS, 0),
        "swap": await _run(dtype, SMALL_KV_BLOCKS, 128 * block_bytes),
    }
    reference = runs["roomy"]["tokens"]
    for name, run in runs.items():
        run["tokens_equal_roomy"] = run.pop("tokens") == reference
        print(f"{name:10s} {json.dumps(run)}")
    report = dict(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), dtype=dtype,
                  workload=dict(requests=NUM_REQUESTS, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS), runs=runs)
    with open(OUT, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "float32"))
