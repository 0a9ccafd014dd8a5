"""SmolLM2-135M's forward per step beside its floors, in bf16, float32 and int8 (weight-only, bf16
compute). A plain script, not a test; ~4-6 minutes on 2 cores.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_forward.py [--label TEXT] [--out PATH]
        [--threads N] [--no-profile] [--variants bfloat16,float32,int8]

The kernel paths are the model service's compute fields, set as it reads them at start, from their
environment aliases: PLANSERVE_GEMM_ISA=avx2 (and PLANSERVE_ATTENTION_ISA, PLANSERVE_LAYER_OPS_ISA)
forces a path on a CPU that has a faster one. With ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2
and MKL_ENABLE_INSTRUCTIONS=AVX2 as well, torch's own kernels (the float32 variant's GEMMs, the
floors' rates) keep to AVX2 too: an AVX2-only CPU run on a newer one.

Cases: decode at batch 1, 16 and 64 (each sequence's context drawn from 280..320) and a 2,048-token
prompt prefilled in one chunk. The forward is the model call alone (all layers, the norm and
lm_head of the sampled rows), as ModelRunner times it in StepResult's forward_ns; the attention
metadata is built once per step outside the timing, as the runner builds it once per plan.

Honest by construction (bench/measure.py): every sequence has its own KV blocks, shuffled across a
cache twice the size the step reads; every figure is the median of at least 10 steps after two
warm-up steps; the floors are measured in the same run:
    memory floor  = (weight bytes + KV bytes the step reads) / read bandwidth of 1 GiB
    compute floor = FLOPs / the dtype's GEMM rate at the model's MLP shape (int8 computes in bf16;
                    the avx2 and avx512 GEMM paths multiply in float32: the float32 rate)
    FLOPs         = 2 * layer params * tokens + 2 * lm_head params * sampled rows
                    + 4 * hidden * layers * attended (query, key) pairs
A per-op profile of one batch-16 bf16 decode step (torch.profiler, top ops by self CPU time) is
written beside the results as <out>.profile.<label>.txt, headed by where the step's time goes by
part (GEMMs, attention, the row-wise layer ops, the rest: Python and torch glue), timed around
each call, for decode at batch 1, 16 and 64: native kernels are no torch ops, so the table alone
does not show them. Where the native decoder loop applies (model_service/models/decoder_loop.py), each
case is timed on a second copy of the model on the Python loop too ("ms_python_loop"), and the
split by part and the profile are of the Python loop (the native loop's calls are not Python's).

The script uses the model API (load_model, KVCache, build_attention_metadata) and, since issue 33,
compute_env_defaults and kernels.gemm: older trees need those two lines taken out.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import measure  # noqa: E402
from model_service.config import ModelServiceConfig, compute_env_defaults  # noqa: E402
from model_service.kernels import gemm  # noqa: E402
from model_service.loading.loader import load_model  # noqa: E402
from model_service.kernels.quant import weight_bytes  # noqa: E402

DECODE_BATCHES = (1, 16, 64)
PREFILL = 2048
VARIANTS = (("bfloat16", "bfloat16", "none"), ("float32", "float32", "none"), ("int8", "bfloat16", "int8"))
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "forward.json")
PROFILE_ROWS = 25


def cases():
    rng = np.random.default_rng(1)
    for b in DECODE_BATCHES:
        yield f"decode b={b}", [(int(c), 1) for c in rng.integers(280, 321, size=b)]
    yield f"prefill {PREFILL}", [(0, PREFILL)]


def step_flops_parts(arch, seqs) -> tuple[float, float]:
    """(the GEMMs' FLOPs, attention's) of a step of `seqs` (context, new tokens)."""
    h, kv = arch.hidden_size, arch.num_key_value_heads * arch.head_dim
    layer_params = h * h * 2 + h * kv * 2 + 3 * h * arch.intermediate_size  # q, o, k, v, gate, up, down
    tokens = sum(n for _, n in seqs)
    attended = sum(c * n + n * (n + 1) // 2 for c, n in seqs)
    gemms = 2.0 * layer_params * arch.num_hidden_layers * tokens + 2.0 * arch.vocab_size * h * len(seqs)
    return gemms, 4.0 * h * arch.num_hidden_layers * attended


def step_flops(arch, seqs) -> float:
    return sum(step_flops_parts(arch, seqs))


def serial_floor_s(arch, seqs, weight_bytes: float, kv_bytes: float, bandwidth: float, rate: float) -> float:
    """A step's floor with its two kinds of work one after the other, each at its own bound: the
    GEMMs (their weights read, or their FLOPs at the matmul rate, whichever is longer), then
    attention (its KV read, or its FLOPs). max(memory floor, FLOP floor) assumes the two overlap;
    a step runs them in turn, so where the GEMMs are FLOP-bound and attention memory-bound (decode
    at large batches) this floor is the higher, and the one a step can approach."""
    gemms, attention = step_flops_parts(arch, seqs)
    return max(weight_bytes / bandwidth, gemms / rate) + max(kv_bytes / bandwidth, attention / rate)


# The calls a step's time is split into (module, function): what exists in this tree is timed.
PARTS = {"gemm": [("model_service.kernels.layer_ops", "linear")],
         "attention": [("model_service.models.llama", "paged_attention")],
         "layer ops": [("model_service.kernels.layer_ops", name) for name in ("add_rms_norm_", "rope_", "silu_mul")]}


def parts_of_step(model, step, reps: int = 10) -> dict[str, float]:
    """Milliseconds per step in each part of PARTS, and the rest, by timing around each call."""
    import importlib
    import time

    spent = {part: 0.0 for part in PARTS}
    patched = []
    for part, calls in PARTS.items():
        for module_name, name in calls:
            module = importlib.import_module(module_name)
            original = getattr(module, name, None)
            if original is None:
                continue

            def timed(*args, _original=original, _part=part, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    spent[_part] += time.perf_counter() - start

            setattr(module, name, timed)
            patched.append((module, name, original))
    try:
        with torch.inference_mode():
            model(*step.args())
            for part in spent:
                spent[part] = 0.0
            start = time.perf_counter()
            for _ in range(reps):
                model(*step.args())
            total = time.perf_counter() - start
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
    out = {part: seconds / reps * 1e3 for part, seconds in spent.items()}
    out["rest"] = total / reps * 1e3 - sum(out.values())
    return out


def profile_decode(model, step, path: str, parts: dict[str, dict[str, float]]) -> None:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for _ in range(3):
            model(*step.args())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(*step.args())
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
    count = sum(event.count for event in prof.key_averages())
    with open(path, "w") as f:
        f.write(f"SmolLM2 bf16 decode, contexts 280..320; {measure.cpu_model()}; {measure.thread_settings()}\n\n")
        f.write("Milliseconds per step by part (timed around each call, mean of 10 steps):\n")
        for case, split in parts.items():
            f.write(f"  {case:12s} " + "  ".join(f"{part} {ms:6.2f}" for part, ms in split.items()) + "\n")
        f.write(f"\nOne b=16 step; {count} profiled op calls:\n{table}\n")
    print(f"wrote {os.path.relpath(path)} ({count} op calls)", file=sys.stderr)


def _slug(label: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in label.lower()).split())


def decoder_loop(model, config) -> tuple[str, object]:
    """Which decoder loop `model` runs (trees before the native loop: "python"), and where that is
    the native one, a second copy of the model on the Python loop (None otherwise)."""
    try:
        from model_service.models import decoder_loop as loops
    except ImportError:
        return "python", None
    reason = loops.unsupported_reason(model)
    if reason is not None:
        return f"python ({reason})", None
    python_model = load_model(config).model
    loops.decide(python_model, "python")
    return "native", python_model


def gemm_path(model) -> str:
    """The GEMM path `model`'s linears run: a packed path's name, else torch's."""
    paths = {m.isa for m in model.modules() if isinstance(m, gemm.PackedLinear)}
    return ",".join(sorted(paths)) or gemm.TORCH_PATH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="after", help="key of this run in the results file")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS), help="which of them, comma-separated")
    args = parser.parse_args()
    compute = compute_env_defaults(os.environ)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]
    bandwidth = measure.read_bandwidth()
    rates = {"bfloat16": measure.gemm_rate(torch.bfloat16), "float32": measure.gemm_rate(torch.float32)}
    print(f"{compute or 'kernel paths: auto'}; {measure.cpu_model()}: read {bandwidth / 1e9:.1f} GB/s, GEMM bf16 {rates['bfloat16'] / 1e9:.0f} / "
          f"float32 {rates['float32'] / 1e9:.0f} GFLOP/s", file=sys.stderr)
    run = {"variants": {}}
    for label, dtype_name, quant in VARIANTS:
        if label not in args.variants.split(","):
            continue
        config = ModelServiceConfig(model="smollm2", dtype=dtype_name, quantization=quant, device="cpu", **compute)
        loaded = load_model(config)
        model, arch, dtype = loaded.model, loaded.arch, getattr(torch, dtype_name)
        loop, python_model = decoder_loop(model, config)
        weights = weight_bytes(model)
        path = gemm_path(model)
        rate = rates["float32"] if path in ("avx2", "avx512") else rates[dtype_name]
        out = run["variants"][label] = {"weight_bytes": weights, "decoder_loop": loop, "gemm": path, "steps": {}}
        parts = {}
        for name, seqs in cases():
            step = measure.Step(seqs, dtype, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, spare_factor=2)
            min_seconds = 1.0 if len(seqs) > 1 or seqs[0][1] == 1 else 0.0
            with torch.inference_mode():
                seconds = measure.median_seconds(lambda: model(*step.args()), min_reps=10, min_seconds=min_seconds)
                python_seconds = python_model and measure.median_seconds(
                    lambda: python_model(*step.args()), min_reps=10, min_seconds=min_seconds)
            flops = step_flops(arch, seqs)
            memory_floor = (weights + step.kv_bytes) / bandwidth
            compute_floor = flops / rate
            floor = max(memory_floor, compute_floor)
            out["steps"][name] = {"ms": seconds * 1e3, "memory_floor_ms": memory_floor * 1e3, "compute_floor_ms": compute_floor * 1e3,
                                  "x_of_floor": seconds / floor, "tokens_per_s": sum(n for _, n in seqs) / seconds, "gflop": flops / 1e9}
            if python_model:
                out["steps"][name]["ms_python_loop"] = python_seconds * 1e3
            print(f"{label:9s} {name:14s} {seconds * 1e3:8.1f} ms  floor {floor * 1e3:6.1f} ms "
                  f"({'memory' if memory_floor > compute_floor else 'compute'})  {seconds / floor:5.1f}x"
                  + (f"  (Python loop {python_seconds * 1e3:.1f} ms)" if python_model else ""), file=sys.stderr, flush=True)
            if label == "bfloat16" and name.startswith("decode") and not args.no_profile:
                # By part, timed around each Python-level call: the Python loop's (the native loop
                # makes the same kernel calls from C++, all of it "rest" here).
                parts[name] = out["steps"][name]["ms_by_part"] = parts_of_step(python_model or model, step)
                if name == "decode b=16":
                    profile_step = step
            del step
        if parts:
            profile_decode(python_model or model, profile_step, f"{os.path.splitext(args.out)[0]}.profile.{_slug(args.label)}.txt", parts)
            del profile_step
        del model, loaded, python_model
    run["compute"] = compute
    run["torch_isa_env"] = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                            if k in os.environ}
    run["machine"] = {"cpu": measure.cpu_model(), **measure.thread_settings(), "read_bandwidth_gb_s": bandwidth / 1e9,
                      "gemm_gflops": {k: v / 1e9 for k, v in rates.items()}, "load_avg_before_after": [load_before, os.getloadavg()[0]],
                      "torch": torch.__version__}
    measure.save_run(args.out, args.label, run)
    print(f"wrote {os.path.relpath(args.out)} [{args.label}]", file=sys.stderr)


if __name__ == "__main__":
    main()
