"""`planserve bench`: run a stored workload against a running server, report JSON and PNG plots.

    planserve serve &                                      # or any planserve / OpenAI server
    planserve bench --workload peer --port 50051 --out bench/results/bench-peer.json
    planserve bench --workload online --request-rate 1 2 4 8 inf --plots bench/results/plots
    planserve bench --workload peer --openai-url http://127.0.0.1:8080 --openai-model smollm2

The progress bar (tqdm) and the plots (matplotlib) come with the `bench` extra:
pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os

from bench.load import report, workloads
from bench.load.loadgen import GrpcBackend, OpenAIBackend, run_workload


def add_parser(commands) -> argparse.ArgumentParser:
    bench = commands.add_parser(
        "bench",
        help="load generator: a stored workload against a server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--workload",
        default="peer",
        help=f"one of {', '.join(workloads.WORKLOADS)} (bench/workloads/NAME.jsonl) "
        "or a .jsonl path",
    )
    bench.add_argument("--host", default="127.0.0.1", help="planserve gRPC host")
    bench.add_argument("--port", type=int, default=50051, help="planserve gRPC port")
    bench.add_argument(
        "--openai-url",
        default=None,
        help="instead of gRPC: an OpenAI-compatible server's base URL (streams /v1/completions)",
    )
    bench.add_argument(
        "--openai-model", default="default", help="the model name sent to --openai-url"
    )
    bench.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests/s, one run per value (inf: every request at t=0; default inf)",
    )
    bench.add_argument("--num-requests", type=int, default=None, help="only the first N requests")
    bench.add_argument("--max-new-tokens", type=int, default=None, help="override every request's")
    bench.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    bench.add_argument(
        "--stream-interval", type=int, default=1, help="tokens per chunk (gRPC only)"
    )
    bench.add_argument(
        "--warmup", type=int, default=1, help="requests sent (4 new tokens) before timing"
    )
    bench.add_argument(
        "--label", default=None, help="engine name in the report (default: the backend)"
    )
    bench.add_argument("--out", default=None, help="JSON report path (default: print it)")
    bench.add_argument("--plots", default=None, help="directory for PNG plots (needs matplotlib)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    return bench


def _backend(args: argparse.Namespace):
    if args.openai_url:
        return OpenAIBackend(args.openai_url, args.openai_model)
    return GrpcBackend(f"{args.host}:{args.port}", stream_interval=args.stream_interval)


async def run_bench(args: argparse.Namespace) -> dict:
    requests = workloads.load(args.workload)
    if args.num_requests is not None:
        requests = requests[: args.num_requests]
    if args.max_new_tokens is not None:
        requests = [dataclasses.replace(r, max_new_tokens=args.max_new_tokens) for r in requests]
    label = args.label or ("openai" if args.openai_url else "planserve")
    runs, per_run_results = [], []
    async with _backend(args) as backend:
        if args.warmup:
            warm = [
                dataclasses.replace(r, id=f"warmup-{r.id}", arrival=0.0, max_new_tokens=4)
                for r in requests[: args.warmup]
            ]
            await run_workload(backend, warm, progress=False)
        for rate in args.request_rate:
            results, elapsed = await run_workload(
                backend,
                requests,
                rate=rate,
                progress=not args.no_progress,
                max_concurrency=args.max_concurrency,
                label=f"{label} rate={rate}",
            )
            runs.append(
                report.summarize(results, elapsed, request_rate=None if math.isinf(rate) else rate)
            )
            per_run_results.append((rate, results))
    out = {
        "engine": label,
        "workload": os.path.basename(args.workload).removesuffix(".jsonl"),
        "backend": "openai" if args.openai_url else "grpc",
        "stream_interval": args.stream_interval,
        "machine": report.machine_note(),
        "runs": runs,
    }
    if args.plots:
        base = os.path.join(args.plots, f"{label}-{out['workload']}")
        for rate, results in per_run_results:
            report.plot_run(
                results, f"{base}-rate-{rate}.png", f"{label} on {out['workload']}, rate {rate}/s"
            )
        if len(runs) > 1:
            report.plot_rate_sweep(
                {label: runs},
                f"{base}-sweep.png",
                f"{label} on {out['workload']}: throughput vs latency",
            )
    return out


def main(args: argparse.Namespace) -> None:
    result = asyncio.run(run_bench(args))
    if args.out:
        report.write_json(result, args.out)
    for run in result["runs"]:
        print(
            f"rate={run['request_rate'] or 'inf'}: {run['output_tokens_per_s']} output tok/s, "
            f"{run['requests_per_s']} req/s, TTFT p50 {run['ttft_ms']['p50']} ms, "
            f"ITL p99 {run['itl_ms']['p99']} ms, E2E p50 {run['e2e_ms']['p50']} ms, "
            f"{run['completed']}/{run['num_requests']} ok"
        )
    if not args.out:
        import json

        print(json.dumps(result, indent=2))
