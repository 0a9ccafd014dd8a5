"""The KV cache's swap copies alone (model_service/attention/kv_cache.py): swap_out then swap_in
of N blocks of SmolLM2's shape in bf16 (30 layers, 3 KV heads of 64, blocks of 16), to swap ids
in one run or scattered, the median of each (bench/measure.py). A plain script, not a test; seconds.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_kv_swap.py [--code ROOT]

--code ROOT times another checkout's KVCache (its model_service), to compare two trees.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", default=ROOT, help="the checkout whose KVCache is timed")
    args = parser.parse_args()
    sys.path.insert(0, args.code)
    import torch

    from bench.measure import median_seconds
    from model_service.attention.kv_cache import KVCache

    torch.manual_seed(0)
    kv = KVCache(30, 2048, 16, 3, 64, torch.bfloat16, "cpu")
    kv.allocate_swap(512)
    for count, in_one_run in ((8, True), (64, True), (64, False)):
        src = torch.randperm(2000)[:count] + 1
        dst = torch.arange(count) if in_one_run else torch.randperm(512)[:count]
        out_ms = median_seconds(lambda s=src, d=dst: kv.swap_out(s, d)) * 1e3
        in_ms = median_seconds(lambda s=src, d=dst: kv.swap_in(d, s)) * 1e3
        ids = "one run" if in_one_run else "scattered"
        print(f"{count} blocks, swap ids {ids}: out {out_ms:.2f} ms, in {in_ms:.2f} ms")


if __name__ == "__main__":
    main()
