"""torch's CPU matmul rate in float32 and bfloat16 at SmolLM2's MLP shape: what decides the dtype
a CPU serves by default, and what the test suite serves there (tests/dtypes.py). A plain script,
a few seconds; run it under a oneDNN cap to see the rate a CPU without native bf16 gets:

    .venv/bin/python bench/bench_matmul_dtypes.py
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/bench_matmul_dtypes.py

Prints GFLOP/s per dtype (each timed for --seconds after a warm-up), torch's CPU capability and
the model service's `--dtype auto` choice under this environment.
"""

from __future__ import annotations

import argparse
import time

import torch

from model_service.config import ModelServiceConfig


def rate(dtype: torch.dtype, rows: int, inner: int, cols: int, seconds: float) -> float:
    """GFLOP/s of [rows x inner] @ [inner x cols] in `dtype`."""
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, cols, dtype=dtype)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * rows * inner * cols * count / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="tokens in the step")
    parser.add_argument("--shape", type=int, nargs=2, default=(576, 1536), help="inner, cols")
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    inner, cols = args.shape
    for dtype in (torch.float32, torch.bfloat16):
        gflops = rate(dtype, args.rows, inner, cols, args.seconds)
        print(f"{dtype}: {gflops:.1f} GFLOP/s ([{args.rows} x {inner}] @ [{inner} x {cols}])")
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    auto = ModelServiceConfig(dtype="auto", device="cpu").resolved_dtype()
    print(f"--dtype auto here: {auto}")


if __name__ == "__main__":
    main()
