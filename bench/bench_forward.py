"""Forward time per step of SmolLM2-135M: decode batches of 1, 8, 32, 128 (context 256 each) and one
2,048-token prefill, for float32, bfloat16 and int8 (weight-only, bfloat16 compute), against the
roofline of the measured matmul rate. A plain script, not a test; ~2-3 minutes on 2 CPU cores.

    cd /work/main && PYTHONPATH=protos:. .venv/bin/python bench/bench_forward.py [THREADS]

Writes bench/results/forward.json and prints a table. The forward is the model call alone
(attention metadata, all layers, lm_head on the sampled rows), as ModelRunner times it in forward_ns.
Decode sequences share one set of KV blocks (reads only matter for time; writes go to a scratch
block), so the KV cache stays small.

Roofline per step:
    flops  = 2 * (layer matmul params) * tokens + 2 * (lm_head params) * sampled rows
             + 4 * (query positions) * (attended context) * hidden * layers    (QK^T and PV)
    bound  = flops / (measured dense matmul rate of that dtype; int8 computes in bfloat16)
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from model_service.attention import build_attention_metadata  # noqa: E402
from model_service.config import ModelServiceConfig  # noqa: E402
from model_service.kv_cache import KVCache  # noqa: E402
from model_service.loader import load_model  # noqa: E402
from model_service.quant import weight_bytes  # noqa: E402

CONTEXT = 256
DECODE_BATCHES = (1, 8, 32, 128)
PREFILL = 2048
BLOCK = 16
VARIANTS = (("float32", "float32", "none"), ("bfloat16", "bfloat16", "none"), ("int8", "bfloat16", "int8"))
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "forward.json")


def timed(fn, min_seconds: float = 1.0, min_reps: int = 3, max_reps: int = 50) -> float:
    """Best seconds per call after one warm-up call. Best, not median: on a shared 2-core machine a
    2-thread op whose second thread is descheduled waits a scheduler tick (~4-8 ms), which swamps
    a decode step; the best call is the one that ran undisturbed."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_seconds and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_rate(dtype: torch.dtype) -> float:
    """FLOP/s of a dense [2048, 576] x [576, 1536] matmul (SmolLM2's MLP shape)."""
    a, b = torch.randn(2048, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    return 2 * 2048 * 576 * 1536 / timed(lambda: a @ b, min_seconds=0.5)


def step_inputs(num_seqs: int, query_len: int, context: int, device: str = "cpu"):
    """Packed inputs of num_seqs sequences, each computing query_len new tokens ending at `context`.

    KV blocks: 1 .. context/BLOCK hold every sequence's context (shared); the block after them is
    the scratch block that all writes of a decode batch land in (a prefill writes its own blocks).
    """
    blocks_per_seq = -(-context // BLOCK)
    table = torch.arange(1, blocks_per_seq + 1, dtype=torch.int64)
    positions = torch.arange(context - query_len, context, dtype=torch.int64).repeat(num_seqs)
    if query_len == context:  # prefill: writes go where they belong
        slot_mapping = table[positions // BLOCK] * BLOCK + positions % BLOCK
    else:
        slot_mapping = (blocks_per_seq + 1) * BLOCK + torch.arange(num_seqs * query_len) % BLOCK
    meta = build_attention_metadata(
        slot_mapping,
        torch.arange(num_seqs, dtype=torch.int64) * query_len,
        torch.full((num_seqs,), query_len, dtype=torch.int64),
        torch.full((num_seqs,), context, dtype=torch.int64),
        table.repeat(num_seqs, 1),
        BLOCK, query_len, context,
    )
    input_ids = torch.randint(100, 40000, (num_seqs * query_len,), generator=torch.Generator().manual_seed(0))
    logits_indices = torch.arange(num_seqs, dtype=torch.int64) * query_len + query_len - 1
    return input_ids, positions, meta, logits_indices, blocks_per_seq + 2


def step_flops(arch, tokens: int, sampled: int, attended: int) -> float:
    h, kv = arch.hidden_size, arch.num_key_value_heads * arch.head_dim
    layer = h * h * 2 + h * kv * 2 + 3 * h * arch.intermediate_size  # q, o, k, v, gate, up, down
    return 2.0 * layer * arch.num_hidden_layers * tokens + 2.0 * arch.vocab_size * h * sampled \
        + 4.0 * attended * h * arch.num_hidden_layers


def main() -> None:
    if len(sys.argv) > 1:  # optional: torch threads
        torch.set_num_threads(int(sys.argv[1]))
    torch.manual_seed(0)
    load_before = os.getloadavg()
    rates = {"float32": matmul_rate(torch.float32), "bfloat16": matmul_rate(torch.bfloat16)}
    rows, results = [], {}
    for label, dtype, quant in VARIANTS:
        config = ModelServiceConfig(model="smollm2", dtype=dtype, quantization=quant, device="cpu")
        loaded = load_model(config)
        model, arch = loaded.model, loaded.arch
        tdtype = getattr(torch, dtype)
        params = sum(p.numel() for p in loaded.model.parameters()) if quant == "none" else None
        cases = [(f"decode b={b}", b, 1, CONTEXT) for b in DECODE_BATCHES] + [(f"prefill {PREFILL}", 1, PREFILL, PREFILL)]
        results[label] = {"weight_bytes": weight_bytes(model), "compute_dtype": dtype, "steps": {}}
        if params:
            results[label]["params"] = params
        for name, num_seqs, query_len, context in cases:
            input_ids, positions, meta, logits_indices, num_blocks = step_inputs(num_seqs, query_len, context)
            kv = KVCache(arch.num_hidden_layers, num_blocks, BLOCK, arch.num_key_value_heads, arch.head_dim, tdtype, "cpu")
            with torch.inference_mode():
                seconds = timed(lambda: model(input_ids, positions, meta, kv, logits_indices),
                                min_seconds=1.5 if query_len == 1 else 0.0, min_reps=5 if query_len == 1 else 2)
            tokens = num_seqs * query_len
            # Attended (query, key) pairs: each decode query sees `context` keys; a causal prefill ~T^2/2.
            attended = num_seqs * context if query_len == 1 else query_len * (query_len + 1) // 2
            flops = step_flops(arch, tokens, num_seqs, attended)
            bound = flops / rates[dtype]
            results[label]["steps"][name] = {
                "ms_per_step": seconds * 1e3, "tokens": tokens, "tokens_per_s": tokens / seconds,
                "gflop": flops / 1e9, "achieved_gflops": flops / seconds / 1e9, "roofline_ms": bound * 1e3,
                "fraction_of_roofline": bound / seconds,
            }
            rows.append((label, name, seconds * 1e3, tokens / seconds, flops / seconds / 1e9, bound * 1e3, bound / seconds))
            print(f"{label:9s} {name:13s} {seconds * 1e3:9.1f} ms", file=sys.stderr, flush=True)
        del model, loaded
    params = results["float32"]["params"]
    first = results["float32"]["steps"][f"decode b={DECODE_BATCHES[0]}"]
    summary = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized)",
        "context_per_decode": CONTEXT,
        "params": params,
        "flops_per_token_decode": first["gflop"] * 1e9 / first["tokens"],
        "matmul_gflops_measured": {k: v / 1e9 for k, v in rates.items()},
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(), "load_avg_before_after": [load_before, os.getloadavg()],
        "timing": "best of >= 5 calls (decode, >= 1.5 s) or 2 calls (prefill) after a warm-up",
        "variants": results,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"matmul rate: float32 {rates['float32'] / 1e9:.0f} GFLOP/s, bfloat16 {rates['bfloat16'] / 1e9:.0f} GFLOP/s; "
          f"params {params / 1e6:.1f}M; decode FLOPs/token at context {CONTEXT}: {summary['flops_per_token_decode'] / 1e6:.0f}M "
          f"(2 x params = {2 * params / 1e6:.0f}M)")
    print("weight bytes: " + ", ".join(f"{k} {v['weight_bytes'] / 2**20:.0f} MiB" for k, v in results.items()))
    print(f"{'variant':9s} {'step':13s} {'ms/step':>9s} {'tok/s':>9s} {'GFLOP/s':>8s} {'roof ms':>8s} {'of roof':>7s}")
    for label, name, ms, tps, gflops, roof_ms, frac in rows:
        print(f"{label:9s} {name:13s} {ms:9.1f} {tps:9.0f} {gflops:8.0f} {roof_ms:8.1f} {frac:7.0%}")
    print(f"wrote {os.path.relpath(OUT)}")


if __name__ == "__main__":
    main()
