"""Paged attention per layer, and SmolLM2's forward at decode batch 16 and a 2,048-token prefill,
each beside its floor measured in the same run. A plain script, not a test; ~3-5 minutes on 2 cores.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_attention.py [--isa NAME ...] [--no-forward]
        [--label TEXT] [--out bench/results/attention.json]

Attention cases use SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64, blocks of 16):
decode at batch 1, 16 and 64 with contexts of 280..320 positions, and a 2,048-token prompt
prefilled in one chunk and in the scheduler's default chunks of 512. Every sequence has its own KV
blocks, shuffled across a cache several times larger than the step reads, so the KV comes from
memory, not from a cache another sequence warmed. Each figure is the median of at least 10 calls
after two warm-up calls.

Floors, measured in the same run by fixed probes:
    memory  = bytes the step must read (KV of every attended position; weights for the forward)
              / bandwidth of a 2-thread read of 1 GiB
    compute = FLOPs (4 * H * D per attended query-key pair; 2 * params per token for the GEMMs)
              / the dtype's GEMM rate at the model's own shapes ([2048, 576] x [576, 1536])

The script only uses the attention API (build_attention_metadata, paged_attention, KVCache), so
it runs unchanged on older trees: that is how the "before" figures were taken.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from model_service import attention  # noqa: E402
from model_service.kv_cache import KVCache  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DECODE_BATCHES = (1, 16, 64)
PREFILL, CHUNK = 2048, 512
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention.json")


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


class Step:
    """One step's sequences on shuffled private blocks: (computed, scheduled) per sequence."""

    def __init__(self, seqs, dtype, spare_factor: int = 4, seed: int = 0):
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
        t = torch.from_numpy
        # Older trees split mixed steps into groups from the host copies; pass them where accepted.
        host = {"host_num_scheduled": scheduled, "host_context_lens": context} \
            if "host_num_scheduled" in inspect.signature(attention.build_attention_metadata).parameters else {}
        self.build = lambda: attention.build_attention_metadata(  # noqa: E731
            t(slots), t(query_start), t(scheduled), t(context), t(tables), BLOCK, int(scheduled.max()), int(context.max()), **host)
        self.kv = KVCache(1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype, "cpu")
        self.kv.k.normal_(), self.kv.v.normal_()
        self.kv.k[:, 0] = self.kv.v[:, 0] = 0
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(len(rows), HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.k = torch.randn(len(rows), KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.v = torch.randn(len(rows), KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.attended = int(sum(c * n + n * (n + 1) // 2 for c, n in seqs))  # (query, key) pairs
        self.kv_bytes = int(context.sum()) * KV_HEADS * HEAD_DIM * 2 * self.kv.k.element_size()


def attention_case(step: Step, isa: str | None) -> float:
    meta = step.build()
    kwargs = {"isa": isa} if isa and "isa" in inspect.signature(attention.paged_attention).parameters else {}
    k_cache, v_cache = step.kv.layer(0)
    return median_seconds(lambda: attention.paged_attention(step.q, step.k, step.v, k_cache, v_cache, meta, **kwargs))


def attention_cases(dtype: torch.dtype):
    rng = np.random.default_rng(1)
    for b in DECODE_BATCHES:
        yield f"decode b={b}", [Step([(int(c), 1) for c in rng.integers(280, 321, size=b)], dtype)]
    yield f"prefill {PREFILL} (one chunk)", [Step([(0, PREFILL)], dtype)]
    yield f"prefill {PREFILL} (chunks of {CHUNK})", [Step([(start, CHUNK)], dtype) for start in range(0, PREFILL, CHUNK)]


def forward_cases(isa: str | None, bandwidth: float, rates: dict) -> dict:
    """SmolLM2's whole forward (bf16 and float32): decode at batch 16 (contexts 280..320) and a
    2,048-token prompt in chunks of 512, against weights+KV bytes / bandwidth and FLOPs / rate."""
    from model_service.config import ModelServiceConfig
    from model_service.loader import load_model

    if isa:
        os.environ[attention.ISA_ENV] = isa
        if hasattr(attention, "ATTENTION_ISA"):
            attention.ATTENTION_ISA = attention.resolve_isa(isa)
    results = {}
    for dtype_name in ("bfloat16", "float32"):
        loaded = load_model(ModelServiceConfig(model="smollm2", dtype=dtype_name, device="cpu"))
        model, arch = loaded.model, loaded.arch
        dtype = getattr(torch, dtype_name)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        layer_params = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
        rng = np.random.default_rng(2)
        contexts = [int(c) for c in rng.integers(280, 321, size=16)]
        cases = {"decode b=16": [[(c, 1) for c in contexts]],
                 f"prefill {PREFILL} in chunks of {CHUNK}": [[(s, CHUNK)] for s in range(0, PREFILL, CHUNK)]}
        out = {}
        for name, chunks in cases.items():
            steps = [_ForwardStep(chunk, arch, dtype) for chunk in chunks]
            with torch.inference_mode():
                seconds = median_seconds(lambda: [model(*s.args()) for s in steps], min_reps=10 if len(steps) == 1 else 5)
            tokens = sum(n for chunk in chunks for _, n in chunk)
            sampled = len(chunks[0]) if len(steps) == 1 else 1
            attended = sum(c * n + n * (n + 1) // 2 for chunk in chunks for c, n in chunk)
            flops = 2 * layer_params * tokens + 2 * arch.vocab_size * arch.hidden_size * sampled \
                + 4 * attended * arch.hidden_size * arch.num_hidden_layers
            kv_bytes = sum(s.kv_read_bytes for s in steps)
            memory_floor = (weight_bytes * len(steps) + kv_bytes) / bandwidth
            compute_floor = flops / rates[dtype_name]
            out[name] = {"ms": seconds * 1e3, "memory_floor_ms": memory_floor * 1e3, "compute_floor_ms": compute_floor * 1e3,
                         "x_of_floor": seconds / max(memory_floor, compute_floor), "gflop": flops / 1e9}
            print(f"forward {dtype_name:9s} {name:28s} {seconds * 1e3:8.1f} ms  floor {max(memory_floor, compute_floor) * 1e3:6.1f} ms",
                  file=sys.stderr, flush=True)
        results[dtype_name] = out
        del model, loaded
    return results


class _ForwardStep:
    def __init__(self, seqs, arch, dtype):
        step = Step(seqs, dtype, spare_factor=2)
        self.meta = step.build()
        num_blocks = step.kv.num_blocks
        self.kv = KVCache(arch.num_hidden_layers, num_blocks, BLOCK, arch.num_key_value_heads, arch.head_dim, dtype, "cpu")
        self.kv.k.normal_(), self.kv.v.normal_()
        self.kv.k[:, 0] = self.kv.v[:, 0] = 0
        positions = np.concatenate([np.arange(c, c + n) for c, n in seqs])
        self.positions = torch.from_numpy(positions.astype(np.int64))
        self.input_ids = torch.randint(100, 40000, (len(positions),), generator=torch.Generator().manual_seed(0))
        ends = np.cumsum([n for _, n in seqs]) - 1
        self.logits_indices = torch.from_numpy(ends.astype(np.int64))
        self.kv_read_bytes = step.kv_bytes * arch.num_hidden_layers

    def args(self):
        return self.input_ids, self.positions, self.meta, self.kv, self.logits_indices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", action="append", help="ISA paths to time (default: the one this tree runs)")
    parser.add_argument("--no-forward", action="store_true", help="attention only")
    parser.add_argument("--label", default="after", help="key of this run in the results file")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    isas = args.isa or [getattr(attention, "ATTENTION_ISA", None)]
    load_before = os.getloadavg()
    bandwidth = read_bandwidth()
    rates = {"bfloat16": gemm_rate(torch.bfloat16), "float32": gemm_rate(torch.float32)}
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, GEMM bf16 {rates['bfloat16'] / 1e9:.0f} / "
          f"float32 {rates['float32'] / 1e9:.0f} GFLOP/s", file=sys.stderr)
    run = {"attention_per_layer": {}}
    for isa in isas:
        per_isa = run["attention_per_layer"][isa or "torch"] = {}
        for dtype in (torch.bfloat16, torch.float32):
            per_dtype = per_isa[str(dtype).replace("torch.", "")] = {}
            for name, steps in attention_cases(dtype):
                seconds = sum(attention_case(step, isa) for step in steps)
                attended = sum(s.attended for s in steps)
                kv_bytes = sum(s.kv_bytes for s in steps)
                flops = 4.0 * HEADS * HEAD_DIM * attended
                memory_floor, compute_floor = kv_bytes / bandwidth, flops / rates[str(dtype).replace("torch.", "")]
                per_dtype[name] = {"ms_per_layer": seconds * 1e3, "memory_floor_ms": memory_floor * 1e3,
                                   "compute_floor_ms": compute_floor * 1e3, "x_of_floor": seconds / max(memory_floor, compute_floor)}
                print(f"attention {isa or 'torch':12s} {str(dtype)[6:]:9s} {name:28s} {seconds * 1e3:8.3f} ms/layer "
                      f"(floor {max(memory_floor, compute_floor) * 1e3:.3f})", file=sys.stderr, flush=True)
    if not args.no_forward:
        run["forward"] = forward_cases(isas[0], bandwidth, rates)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    run["machine"] = {"cpu": cpu, "torch_threads": torch.get_num_threads(), "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
                      "read_bandwidth_gb_s": bandwidth / 1e9, "gemm_gflops": {k: v / 1e9 for k, v in rates.items()},
                      "load_avg_before_after": [load_before[0], os.getloadavg()[0]], "torch": torch.__version__}
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    results[args.label] = run
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} [{args.label}]", file=sys.stderr)


if __name__ == "__main__":
    main()
