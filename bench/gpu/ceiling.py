"""The ceiling of one shape: a decode step of the served batch size replayed from the model
service's CUDA graphs (bench/bench_cuda_forward.py's graph_ms: model_service/step/cuda_graphs.py),
beside the same step run eagerly and its floors. Run by bench/bench_gpu_serve.py as a child
process, after the server is gone, so the model here has the GPU to itself:

    python -m bench.gpu.ceiling --shape llama-1b --batch 180 --context 400 --out C.json

The step: `batch` decode rows, contexts spread +-10% around `context`, each sequence on its own
shuffled KV blocks (bench/measure.py's Step). Floors from probes in the same process:
    memory floor = (weight bytes + KV bytes the step reads) / device copy bandwidth
    FLOP floor   = the step's FLOPs (bench_forward.step_flops) / a square bf16 matmul's rate
    serial floor = the GEMMs at their bound, then attention at its own
                   (bench_forward.serial_floor_s)
Ceiling tok/s = batch / graph replay time (eager time where no graph serves: on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

# Probe sizes: a GPU's (1 GiB copied, 8192^3 matmul) and a CPU dry run's.
PROBES = {"cuda": (1 << 30, 8192), "cpu": (64 << 20, 512)}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def median_ms(fn, device: str, reps: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn() in ms, the device synchronized around each call."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def probes(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(copy bytes/s counting bytes read and written, matmul FLOP/s) on the device."""
    size, n = PROBES["cuda" if device.startswith("cuda") else "cpu"]
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * size / (median_ms(lambda: dst.copy_(src), device, reps=10) / 1e3)
    a = torch.randn(n, n, dtype=dtype, device=device)
    rate = 2 * n**3 / (median_ms(lambda: a @ a, device, reps=10) / 1e3)
    return bandwidth, rate


def ceiling(shape: str, device: str, dtype_name: str, batch: int, context: int) -> dict:
    from bench import measure
    from bench.bench_cuda_forward import graph_ms
    from bench.bench_forward import serial_floor_s, step_flops
    from model_service.config import ModelServiceConfig
    from model_service.kernels.quant import weight_bytes
    from model_service.loading.loader import load_model

    dtype = DTYPES[dtype_name]
    bandwidth, rate = probes(device, dtype)
    config = ModelServiceConfig(model=shape, load_format="dummy", dtype=dtype_name, device=device)
    loaded = load_model(config)
    model, arch = loaded.model, loaded.arch
    spread = max(1, context // 10)
    rng = np.random.default_rng(0)
    contexts = rng.integers(max(2, context - spread), context + spread + 1, size=batch)
    seqs = [(int(c) - 1, 1) for c in contexts]
    step = measure.Step(seqs, dtype, arch.num_hidden_layers, arch.num_key_value_heads,
                        arch.head_dim, spare_factor=2, device=device)  # fmt: skip
    with torch.inference_mode():
        eager = median_ms(lambda: model(*step.args()), device)
    graph, error = None, None
    try:
        graph = graph_ms(model, step, arch) if device.startswith("cuda") else None
    except Exception as failure:  # recorded: the eager figure still stands
        error = repr(failure)[:300]
    weights = weight_bytes(model)
    memory_floor = (weights + step.kv_bytes) / bandwidth * 1e3
    flop_floor = step_flops(arch, seqs) / rate * 1e3
    serial_floor = serial_floor_s(arch, seqs, weights, step.kv_bytes, bandwidth, rate) * 1e3
    best = graph if graph is not None else eager
    return {
        "batch": batch,
        "mean_context": round(float(contexts.mean()), 1),
        "graph_ms": None if graph is None else round(graph, 3),
        "eager_ms": round(eager, 3),
        "graph_error": error,
        "memory_floor_ms": round(memory_floor, 3),
        "flop_floor_ms": round(flop_floor, 3),
        "floor_ms": round(max(memory_floor, flop_floor), 3),
        "serial_floor_ms": round(serial_floor, 3),
        "ceiling_tokens_per_s": round(batch / best * 1e3, 1),
        "floor_tokens_per_s": round(batch / max(memory_floor, flop_floor) * 1e3, 1),
        "weight_bytes": weights,
        "kv_bytes_read": step.kv_bytes,
        "copy_tb_s": round(bandwidth / 1e12, 3),
        "matmul_tflops": round(rate / 1e12, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    result = ceiling(args.shape, args.device, args.dtype, max(1, args.batch), args.context)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
