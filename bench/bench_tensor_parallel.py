"""Tensor parallel step time on this machine: `python -m model_service --tensor-parallel-size N`
behind a real scheduler, B concurrent greedy streams, ms per decode step (wall time of the steps
after every prompt is computed, divided by their count) for each N given.

On a CPU the ranks split the cores (torch threads per rank = cores // N), and every layer adds two
gloo all_reduces of [B, hidden] plus one plan broadcast per step, so this measures the cost of
the coordination more than a speed-up; on GPUs (nccl) the split is what lets a model that does not
fit one device run at all.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_tensor_parallel.py --model tiny --sizes 1 2
    PYTHONPATH=protos:. .venv/bin/python bench/bench_tensor_parallel.py --model smollm2 --sizes 1 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos")]

from planserve.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402
from scheduler_service.config import SchedulerConfig  # noqa: E402
from scheduler_service.server import SchedulerServer  # noqa: E402

import grpc  # noqa: E402


def _request(prompt: list[int], new_tokens: int) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest()
    request.token_ids.ids.extend(prompt)
    request.sampling.temperature = 0.0
    request.stopping.max_new_tokens = new_tokens
    request.stopping.ignore_eos = True
    return request


async def _measure(model: str, size: int, batch: int, new_tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "protos")]), PLANSERVE_LOG_JSON="1")
    engine = subprocess.Popen([sys.executable, "-m", "model_service", "--model", model, "--dtype", "float32", "--port", "0",
                               "--num-kv-blocks", "512", "--tensor-parallel-size", str(size)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        port = next(line.split("=", 1)[1].strip() for line in engine.stdout if line.startswith("PLANSERVE_ENGINE_PORT="))
        server = SchedulerServer(SchedulerConfig(port=0, engine_address=f"127.0.0.1:{port}", max_num_seqs=batch,
                                                 max_num_batched_tokens=2048))
        await server.start()
        await server.connect_engine()
        try:
            stub = generate_pb2_grpc.GenerationServiceStub(grpc.aio.insecure_channel(f"127.0.0.1:{server.port}"))
            prompts = [[100 + 17 * i + j for j in range(16)] for i in range(batch)]
            first_tokens = 0
            start_steps = start_time = None

            async def stream(prompt):
                nonlocal first_tokens, start_steps, start_time
                async for _ in stub.Generate(_request(prompt, new_tokens)):
                    if start_time is None:
                        first_tokens += 1
                        if first_tokens == batch:  # every prompt computed: decode steps from here
                            start_steps, start_time = server.loop.num_steps, time.perf_counter()
            await asyncio.gather(*(stream(p) for p in prompts))
            elapsed, steps = time.perf_counter() - start_time, server.loop.num_steps - start_steps
        finally:
            await server.stop(grace_s=1)
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    return {"tensor_parallel_size": size, "batch": batch, "decode_steps": steps,
            "ms_per_decode_step": round(1000 * elapsed / steps, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    results = [asyncio.run(_measure(args.model, size, args.batch, args.new_tokens)) for size in args.sizes]
    print(json.dumps({"model": args.model, "cpus": os.cpu_count(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
