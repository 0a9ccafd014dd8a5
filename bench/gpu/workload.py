"""The GPU benchmark's workloads: "big" as stored (bench/workloads/big.jsonl), or "dry", the CPU
dry run's (16 requests at t=0 of 8..64 random ids, 8 new tokens each), made the same way."""

from __future__ import annotations

from bench.load import workloads
from bench.load.workloads import BenchRequest


def workload_requests(name: str) -> list[BenchRequest]:
    if name == "dry":
        return workloads.random_ids("dry", 16, (8, 64), 8, seed=0)
    return workloads.load(name)
