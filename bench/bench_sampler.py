"""A sampled step's sampling alone: the fused Triton kernel (model_service/kernels/triton_sample.py)
against the torch path it replaces on CUDA (sampler.torch_sample), per batch size and parameter
mix. A plain script, not a test; a few seconds on a GPU.

    PYTHONPATH=protos:. python bench/bench_sampler.py [--device cuda] [--rows 1,64,256]
        [--vocab 49152,128256] [--reps 30] [--out PATH]

Each figure is the median of --reps calls after 3 warm-up calls, the device synchronized around
each: milliseconds from float32 logits [R, V] to the token ids on the device, the parameters'
host-to-device copy included (both paths make one or more), the ids' copy back not. The mixes are
what served requests ask: temperature only, top-p 0.9, top-k 50 with top-p 0.9 (every row the
same mix, seeded, drawing at distinct positions). Logits are random normal with a few large
values a row, so top-p keeps a few tokens, as a trained model's would.

Where the kernel cannot run (a CPU, or no Triton) its column says why and only the torch path is
timed; the script's CPU run is its dry run (tests/bench/test_bench_sampler.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.gpu.ceiling import median_ms  # noqa: E402
from bench.gpu.machine import machine  # noqa: E402
from model_service.step import sampler  # noqa: E402
from model_service.step.sampler import SamplingBatch  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sampler.json")
MIXES = {  # name: (temperature, top_k, top_p)
    "temperature": (0.8, 0, 1.0),
    "top_p": (0.8, 0, 0.9),
    "top_k_top_p": (0.8, 50, 0.9),
}


def logits_for(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * 1_000_003 + vocab)
    logits = torch.randn(rows, vocab, generator=generator)
    peaks = torch.randint(0, vocab, (rows, 8), generator=generator)
    logits.scatter_(1, peaks, 12.0 + 2.0 * torch.rand(rows, 8, generator=generator))
    return logits.to(device)


def batch_for(rows: int, mix: tuple[float, int, float]) -> SamplingBatch:
    temperature, top_k, top_p = mix
    return SamplingBatch(
        temperature=np.full(rows, temperature, dtype=np.float32),
        top_k=np.full(rows, top_k, dtype=np.int64),
        top_p=np.full(rows, top_p, dtype=np.float32),
        seed=np.arange(rows, dtype=np.uint64) + np.uint64(7),
        position=np.arange(rows, dtype=np.int64) + 100,
    )


def measure_case(rows: int, vocab: int, mix: str, device: torch.device, reps: int) -> dict:
    logits, params = logits_for(rows, vocab, device), batch_for(rows, MIXES[mix])
    case = {"rows": rows, "vocab": vocab, "mix": mix}
    case["torch_ms"] = round(
        median_ms(lambda: sampler.torch_sample(logits, params), device.type, reps), 4
    )
    path = sampler.device_path(device)  # the path sample() takes here: "triton" or "torch (why)"
    if path != sampler.TRITON:
        case["triton_ms"], case["triton_unavailable"] = None, path
        return case
    case["triton_ms"] = round(
        median_ms(lambda: sampler.sample(logits, params), device.type, reps), 4
    )
    # The same draws, bar the few-ulp cases the kernel's tests bound (a count, not an assert).
    same = sampler.sample(logits, params).eq(sampler.torch_sample(logits, params))
    case["tokens_equal_to_torch"] = f"{int(same.sum())}/{rows}"
    return case


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", default="1,64,256", help="batch sizes, comma-separated")
    parser.add_argument("--vocab", default="49152,128256", help="vocabulary sizes")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cases = [
        measure_case(rows, vocab, mix, device, args.reps)
        for vocab in (int(v) for v in args.vocab.split(","))
        for rows in (int(r) for r in args.rows.split(","))
        for mix in MIXES
    ]
    for case in cases:
        print(json.dumps(case), file=sys.stderr)
    report = {"machine": machine(device.type), "reps": args.reps, "cases": cases}
    with open(args.out, "w") as out:
        json.dump(report, out, indent=1)
    return report


if __name__ == "__main__":
    main()
