"""Multi-LoRA serving against the base model, served: the peer workload (bench/workloads/peer.jsonl:
16 prompts of 32..512 tokens, 128 greedy new tokens, EOS ignored, all at t=0) through `planserve
serve` (SmolLM2, the default dtype) started with 8 random rank-16 adapters on every target
(`--enable-lora --max-loras 8 --max-cpu-loras 8 --lora-modules ...`), every request on one of them
(round robin, gRPC `lora_name`), against the same requests on the base model, on the same server,
the two alternated --rounds times. The figure is each case's output tok/s and their ratio (the LoRA
issue's goal: >= 0.8x the base in the same run).

    PYTHONPATH=$PWD:$PWD/protos .venv/bin/python bench/bench_lora_serve.py [--rounds 2] \\
        [--adapters 8] [--rank 16] [--out bench/results/lora_serve.json]

--dry-run serves the tiny model with two rank-4 adapters and 4 short requests (what CI runs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos")]

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bench.bench_lora_step import write_adapter  # noqa: E402
from bench.load import report, workloads  # noqa: E402
from bench.load.loadgen import GrpcBackend, run_workload  # noqa: E402
from bench.load.workloads import BenchRequest  # noqa: E402
from bench.measure import cpu_model  # noqa: E402

START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_adapters(model: str, folder: str, count: int, rank: int) -> list[str]:
    """`count` random PEFT folders of `rank` on every target of the model's shape."""
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model

    arch = load_model(ModelServiceConfig(model=model, dtype="float32")).arch
    paths = []
    for index in range(count):
        path = os.path.join(folder, f"a{index}")
        write_adapter(path, arch, rank, seed=index + 1)
        paths.append(path)
    return paths


def start_server(model: str, adapters: list[str], port: int, log) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "tools", "serve", "--model", model,
        "--port", str(port), "--engine-port", "0", "--http-port", "-1", "--metrics-port", "-1",
        "--enable-lora", "--max-loras", str(len(adapters)), "--max-cpu-loras", str(len(adapters)),
        "--max-lora-rank", "64",
        "--lora-modules", *(f"a{i}={path}" for i, path in enumerate(adapters)),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT]))
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


async def wait_serving(address: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"planserve serve exited with {process.returncode}")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"planserve serve not serving after {START_TIMEOUT_S} s")


async def one_case(address: str, requests: list[BenchRequest], lora_names: list[str]) -> dict:
    async with GrpcBackend(address, lora_names=lora_names) as backend:
        results, elapsed = await run_workload(backend, requests, progress=False)
    summary = report.summarize(results, elapsed)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


async def measure(address: str, requests, adapters: int, rounds: int) -> dict:
    names = [f"a{i}" for i in range(adapters)]
    await one_case(address, requests[:2], [])  # warm-up: first steps, first adapter loads
    await one_case(address, requests[:2], names)
    cases: dict[str, list[dict]] = {"base": [], "adapters": []}
    for _ in range(rounds):
        for case, lora_names in (("base", []), ("adapters", names)):
            summary = await one_case(address, requests, lora_names)
            cases[case].append(summary)
            print(case, summary["output_tokens_per_s"], "output tok/s", flush=True)
    best = {case: max(s["output_tokens_per_s"] for s in runs) for case, runs in cases.items()}
    return {
        "cases": cases,
        "best_output_tokens_per_s": best,
        "ratio_of_best": round(best["adapters"] / best["base"], 3),
        "ratio_per_round": [
            round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 3)
            for a, b in zip(cases["adapters"], cases["base"])
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "lora_serve.json"))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    requests = workloads.load("peer")
    if args.dry_run:
        args.model, args.adapters, args.rank, args.rounds = "tiny", 2, 4, 1
        requests = [BenchRequest(r.id, 0.0, r.prompt_ids[:16], 8) for r in requests[:4]]
    port = _free_port()
    with tempfile.TemporaryDirectory() as folder:
        adapters = write_adapters(args.model, folder, args.adapters, args.rank)
        log = open(os.path.join(folder, "serve.log"), "w")
        process = start_server(args.model, adapters, port, log)
        try:
            address = f"127.0.0.1:{port}"
            asyncio.run(wait_serving(address, process))
            figures = asyncio.run(measure(address, requests, args.adapters, args.rounds))
        finally:
            process.terminate()
            process.wait(30)
            log.close()
    result = {
        "model": args.model,
        "adapters": args.adapters,
        "rank": args.rank,
        "workload": "peer" if not args.dry_run else "peer, cut for the dry run",
        "cpu": cpu_model(),
        "machine": report.machine_note(),
        **figures,
    }
    print(f"adapters / base: {result['ratio_of_best']} (per round {result['ratio_per_round']})")
    if not args.dry_run:
        report.write_json(result, args.out)


if __name__ == "__main__":
    main()
