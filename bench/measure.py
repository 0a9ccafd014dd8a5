"""What the forward benchmarks share: medians, the floors' probes, and steps on private blocks.

Every figure is a median of repeated calls after warm-up (never a best-of: a best call hides the
descheduling a 2-core machine shows its users). Floors are measured in the same run by fixed
probes, so a figure and its floor always come from the same machine state:

    read_bandwidth()   bytes/s of a 1 GiB read by torch's threads (one pass, no writes)
    gemm_rate(dtype)   FLOP/s of SmolLM2's MLP-shaped GEMM, [2048, 576] x [576, 1536]

`Step` lays a step's sequences on private KV blocks shuffled across a cache several times larger
than the step reads, so no sequence finds its KV in a cache another sequence warmed.
"""
from __future__ import annotations

import inspect
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from model_service.attention import paged as attention
from model_service.attention.kv_cache import KVCache

BLOCK = 16


def median_seconds(fn, min_reps: int = 10, min_seconds: float = 0.5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_seconds and len(times) < 200):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth() -> float:
    """Bytes/s of a read of 1 GiB by torch's threads (a sum: one pass, no writes)."""
    data = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    return data.numel() * 4 / median_seconds(lambda: data.sum(), min_reps=5, min_seconds=0.0, warmup=1)


def gemm_rate(dtype: torch.dtype) -> float:
    """FLOP/s of SmolLM2's MLP-shaped GEMM, [2048, 576] x [576, 1536]."""
    a, b = torch.randn(2048, 576).to(dtype), torch.randn(576, 1536).to(dtype)
    return 2 * 2048 * 576 * 1536 / median_seconds(lambda: a @ b, min_reps=5)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def thread_settings() -> dict:
    """torch's thread count and every OpenMP variable this process runs under."""
    return {"torch_threads": torch.get_num_threads(),
            "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))}}


def save_run(path: str, label: str, run: dict) -> None:
    """Stores `run` under `label` in the JSON results file at `path` (other labels kept)."""
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    results[label] = run
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


class Step:
    """One step's sequences, given as (computed, scheduled) pairs, on shuffled private blocks of a
    cache with `num_layers` layers; `args()` are the model's forward arguments."""

    def __init__(self, seqs, dtype, num_layers: int = 1, kv_heads: int = 3, head_dim: int = 64,
                 spare_factor: int = 4, seed: int = 0, device: str = "cpu"):
        rng = np.random.default_rng(seed)
        computed = np.array([c for c, _ in seqs], dtype=np.int64)
        scheduled = np.array([n for _, n in seqs], dtype=np.int64)
        context = computed + scheduled
        blocks_per_seq = -(-context // BLOCK)
        num_blocks = 1 + int(blocks_per_seq.sum()) * spare_factor
        ids = rng.permutation(np.arange(1, num_blocks))
        tables = np.zeros((len(seqs), int(blocks_per_seq.max())), dtype=np.int64)
        first = 0
        for b, count in enumerate(blocks_per_seq):
            tables[b, :count] = ids[first : first + count]
            first += count
        rows = [(b, p) for b in range(len(seqs)) for p in range(computed[b], context[b])]
        slots = np.array([tables[b, p // BLOCK] * BLOCK + p % BLOCK for b, p in rows], dtype=np.int64)
        query_start = np.concatenate(([0], np.cumsum(scheduled)[:-1])).astype(np.int64)
        t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        # Older trees split mixed steps into groups from the host copies; pass them where accepted.
        host = {"host_num_scheduled": scheduled, "host_context_lens": context} \
            if "host_num_scheduled" in inspect.signature(attention.build_attention_metadata).parameters else {}
        self.build = lambda: attention.build_attention_metadata(  # noqa: E731
            t(slots), t(query_start), t(scheduled), t(context), t(tables), BLOCK, int(scheduled.max()), int(context.max()), **host)
        self.kv = KVCache(num_layers, num_blocks, BLOCK, kv_heads, head_dim, dtype, device)
        self.kv.k.normal_(), self.kv.v.normal_()
        self.kv.k[:, 0] = self.kv.v[:, 0] = 0
        self.num_rows = len(rows)
        self.attended = int(sum(c * n + n * (n + 1) // 2 for c, n in seqs))  # (query, key) pairs
        self.kv_bytes = int(context.sum()) * kv_heads * head_dim * 2 * self.kv.k.element_size() * num_layers
        positions = np.concatenate([np.arange(c, c + n) for c, n in seqs]).astype(np.int64)
        self.positions = t(positions)
        self.input_ids = torch.randint(100, 40000, (len(positions),), generator=torch.Generator().manual_seed(seed)).to(device)
        self.logits_indices = t((np.cumsum(scheduled) - 1).astype(np.int64))
        # The host arrays, as the runner's StepInputs holds them (bench_cuda_forward's graphs).
        self.host = {"input_ids": self.input_ids.cpu().numpy(), "positions": positions, "slot_mapping": slots,
                     "context_lens": context, "block_tables": tables, "num_scheduled": scheduled}
        self.meta = None

    def args(self):
        if self.meta is None:
            self.meta = self.build()
        return self.input_ids, self.positions, self.meta, self.kv, self.logits_indices
