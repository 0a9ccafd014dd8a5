"""Paged attention per layer, and SmolLM2's forward at decode batch 16 and a 2,048-token prefill,
each beside its floor measured in the same run. A plain script, not a test; ~3-5 minutes on 2 cores.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_attention.py [--isa NAME ...] [--no-forward]
        [--label TEXT] [--out bench/results/attention.json]

Attention cases use SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64, blocks of 16):
decode at batch 1, 16 and 64 with contexts of 280..320 positions (b=16 also walking 30 layers' caches,
as a forward does: one layer's KV stays in L3 between calls, 30 layers' do not), and a 2,048-token prompt
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
import itertools
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import measure  # noqa: E402
from bench.measure import median_seconds  # noqa: E402
from model_service.attention import paged as attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
MODEL_LAYERS = 30
DECODE_BATCHES = (1, 16, 64)
PREFILL, CHUNK = 2048, 512
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention.json")


class Step(measure.Step):
    """A one-layer step with SmolLM2's attention shapes, plus its q, k, v rows."""

    def __init__(self, seqs, dtype, spare_factor: int = 4, seed: int = 0, num_layers: int = 1):
        super().__init__(seqs, dtype, num_layers, KV_HEADS, HEAD_DIM, spare_factor, seed)
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(self.num_rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.k = torch.randn(self.num_rows, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.v = torch.randn(self.num_rows, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)


def attention_case(step: Step, isa: str | None) -> float:
    meta = step.build()
    kwargs = {"isa": isa} if isa and "isa" in inspect.signature(attention.paged_attention).parameters else {}
    layers = [step.kv.layer(i) for i in range(step.kv.k.shape[0])]
    calls = itertools.count()

    def call():  # each call the next layer's cache, as a forward walks them
        k_cache, v_cache = layers[next(calls) % len(layers)]
        return attention.paged_attention(step.q, step.k, step.v, k_cache, v_cache, meta, **kwargs)

    return median_seconds(call)


def attention_cases(dtype: torch.dtype):
    rng = np.random.default_rng(1)
    for b in DECODE_BATCHES:
        contexts = [(int(c), 1) for c in rng.integers(280, 321, size=b)]
        yield f"decode b={b}", [Step(contexts, dtype)]
        if b == 16:
            # One layer's KV at b=16 (~3.7 MB in bf16) stays in L3 from call to call; SmolLM2's 30
            # layers (~110 MB) do not, so in a forward every block comes from memory.
            yield f"decode b={b}, {MODEL_LAYERS} layers", [Step(contexts, dtype, num_layers=MODEL_LAYERS)]
    yield f"prefill {PREFILL} (one chunk)", [Step([(0, PREFILL)], dtype)]
    yield f"prefill {PREFILL} (chunks of {CHUNK})", [Step([(start, CHUNK)], dtype) for start in range(0, PREFILL, CHUNK)]


def forward_cases(isa: str | None, bandwidth: float, rates: dict) -> dict:
    """SmolLM2's whole forward (bf16 and float32): decode at batch 16 (contexts 280..320) and a
    2,048-token prompt in chunks of 512, against weights+KV bytes / bandwidth and FLOPs / rate."""
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model

    if isa:
        attention.PATH.select(isa)
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
            steps = [measure.Step(chunk, dtype, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, spare_factor=2)
                     for chunk in chunks]
            with torch.inference_mode():
                seconds = median_seconds(lambda: [model(*s.args()) for s in steps], min_reps=10 if len(steps) == 1 else 5)
            tokens = sum(n for chunk in chunks for _, n in chunk)
            sampled = len(chunks[0]) if len(steps) == 1 else 1
            attended = sum(c * n + n * (n + 1) // 2 for chunk in chunks for c, n in chunk)
            flops = 2 * layer_params * tokens + 2 * arch.vocab_size * arch.hidden_size * sampled \
                + 4 * attended * arch.hidden_size * arch.num_hidden_layers
            kv_bytes = sum(s.kv_bytes for s in steps)
            memory_floor = (weight_bytes * len(steps) + kv_bytes) / bandwidth
            compute_floor = flops / rates[dtype_name]
            out[name] = {"ms": seconds * 1e3, "memory_floor_ms": memory_floor * 1e3, "compute_floor_ms": compute_floor * 1e3,
                         "x_of_floor": seconds / max(memory_floor, compute_floor), "gflop": flops / 1e9}
            print(f"forward {dtype_name:9s} {name:28s} {seconds * 1e3:8.1f} ms  floor {max(memory_floor, compute_floor) * 1e3:6.1f} ms",
                  file=sys.stderr, flush=True)
        results[dtype_name] = out
        del model, loaded
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", action="append", help="ISA paths to time (default: the one this tree runs)")
    parser.add_argument("--no-forward", action="store_true", help="attention only")
    parser.add_argument("--label", default="after", help="key of this run in the results file")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    isas = args.isa or [attention.PATH.current]
    load_before = os.getloadavg()
    bandwidth = measure.read_bandwidth()
    rates = {"bfloat16": measure.gemm_rate(torch.bfloat16), "float32": measure.gemm_rate(torch.float32)}
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
                kv_bytes = sum(s.kv_bytes // s.kv.k.shape[0] for s in steps)  # one layer's
                flops = 4.0 * HEADS * HEAD_DIM * attended
                memory_floor, compute_floor = kv_bytes / bandwidth, flops / rates[str(dtype).replace("torch.", "")]
                per_dtype[name] = {"ms_per_layer": seconds * 1e3, "memory_floor_ms": memory_floor * 1e3,
                                   "compute_floor_ms": compute_floor * 1e3, "x_of_floor": seconds / max(memory_floor, compute_floor)}
                print(f"attention {isa or 'torch':12s} {str(dtype)[6:]:9s} {name:28s} {seconds * 1e3:8.3f} ms/layer "
                      f"(floor {max(memory_floor, compute_floor) * 1e3:.3f})", file=sys.stderr, flush=True)
    if not args.no_forward:
        run["forward"] = forward_cases(isas[0], bandwidth, rates)
    run["machine"] = {"cpu": measure.cpu_model(), **measure.thread_settings(),
                      "read_bandwidth_gb_s": bandwidth / 1e9, "gemm_gflops": {k: v / 1e9 for k, v in rates.items()},
                      "load_avg_before_after": [load_before[0], os.getloadavg()[0]], "torch": torch.__version__}
    measure.save_run(args.out, args.label, run)
    print(f"wrote {args.out} [{args.label}]", file=sys.stderr)


if __name__ == "__main__":
    main()
