"""planserve served on a GPU beside its ceiling and transformers, for each model shape, in one
command on a CUDA machine with torch and no network (dummy weights: no checkpoint, no download).

    GPU_KIT=.gpu-kit OUT=/tmp/out bench/gpu/run.sh       # install, build, CUDA tests, this
    PYTHONPATH=/tmp/planserve-deps:.:protos python3 bench/bench_gpu_serve.py
        [--shapes smollm2-135m,llama-1b,llama-8b] [--max-seconds 90] [--budget-seconds 340]
        [--no-transformers] [--no-ceiling] [--serve-flags "--max-num-seqs 256"]
        [--client-processes 4] [--out bench/results/gpu_serve.json] [--log-dir DIR]
    PYTHONPATH=.:protos python bench/bench_gpu_serve.py --dry-run    # the CPU check CI runs

/tmp/planserve-deps: planserve's dependencies the CUDA torch image lacks, installed there with
`pip install --no-index --no-deps --target` from the kit bench/gpu/prepare.sh makes (run.sh does
it, and builds the Cython extensions in place). Nothing of planserve is installed: the services
run as `python -m tools serve` from this checkout.

For each shape in turn (tiny and the others: model_service/loading/shapes.py):
  serve        `planserve serve --device cuda --load-format dummy --model SHAPE` with no token
               budget, sequence limit or KV size given (the model service sizes them for the
               device; Describe's reply is recorded), then the workload (default "big":
               bench/workloads/big.jsonl, 512 requests at t=0, 256 new tokens each, EOS ignored)
               through the gRPC load generator (bench/load/loadgen.py) in --client-processes
               processes (bench/gpu/clients.py): output tok/s, TTFT, ITL; while it runs, GPU
               utilization and memory (nvidia-smi every 200 ms), the running batch
               (GetServerStatus every 200 ms) and each CPU% (bench/gpu/monitor.py): the
               scheduler, its frontend processes, the model service, the clients; from
               /metrics, the forward's time a step beside the run's wall time a step
  ceiling      a decode step at the mean running batch replayed from the CUDA graphs, beside its
               memory and FLOP floors (bench/gpu/ceiling.py, a child process)
  transformers static batches of 256 of the same workload on the same GPU (bench/gpu/hf_static.py,
               a child process)
Every phase stops at --max-seconds (its requests then count as failed, or its batches as not
run), and at what --budget-seconds leaves of the whole run (under 20 s left: skipped); the JSON is
rewritten after every phase, so a run cut off still leaves what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos")]

from bench.gpu.clients import send_workload  # noqa: E402
from bench.gpu.machine import machine  # noqa: E402
from bench.gpu.monitor import CpuMeter, GpuMonitor, percentiles  # noqa: E402
from bench.gpu.workload import workload_requests  # noqa: E402

OUT = os.path.join(ROOT, "bench", "results", "gpu_serve.json")
SHAPES = ("smollm2-135m", "llama-1b", "llama-8b")
PORT_LINE = "PLANSERVE_PORT="
FORWARD = "planserve_model_forward_seconds"
_STARTED = time.perf_counter()


def progress(message: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def phase_limit(args) -> float:
    """Seconds the next phase may take: --max-seconds, less when --budget-seconds runs out."""
    return min(args.max_seconds, args.budget_seconds - (time.perf_counter() - _STARTED))


def child_env() -> dict[str, str]:
    """This process's environment with the checkout (and protos) first on PYTHONPATH."""
    path = [ROOT, os.path.join(ROOT, "protos"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Serve:
    """`planserve serve` of one shape as a child process (its own session, so it and its model
    service child end together), stopped with SIGTERM as a user stops it."""

    def __init__(self, shape: str, args, log_path: str) -> None:
        self.engine_port, self.metrics_port = free_port(), free_port()
        self.argv = [sys.executable, "-m", "tools", "serve", "--device", args.device,
                     "--load-format", "dummy", "--model", shape, "--port", "0",
                     "--engine-port", str(self.engine_port), "--http-port", "-1",
                     "--metrics-port", str(self.metrics_port),
                     *shlex.split(args.serve_flags)]  # fmt: skip
        if args.dtype != "auto":
            self.argv += ["--dtype", args.dtype]
        self.log_path = log_path

    async def start(self, timeout_s: float) -> str:
        """Starts it; returns the public API's address once it serves."""
        with open(self.log_path, "ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, stdout=asyncio.subprocess.PIPE, stderr=log, env=child_env(),
                start_new_session=True, cwd=ROOT,
            )  # fmt: skip
        assert self.process.stdout is not None
        while True:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
            if not line:
                raise RuntimeError(f"planserve serve exited ({self.log_path} says why)")
            if line.decode().startswith(PORT_LINE):
                return f"127.0.0.1:{int(line.decode().strip()[len(PORT_LINE) :])}"

    async def stop(self) -> None:
        process = getattr(self, "process", None)
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 30)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the session this script started
            await process.wait()


async def describe(engine_address: str) -> dict:
    """The model service's Describe reply, less the tokenizer and template."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from planserve.v1 import engine_pb2, engine_pb2_grpc

    async with grpc.aio.insecure_channel(engine_address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        reply = await stub.Describe(engine_pb2.DescribeRequest(), timeout=60)
    facts = MessageToDict(reply, preserving_proto_field_name=True)
    for bulky in ("tokenizer_json", "chat_template", "special_tokens"):
        facts.pop(bulky, None)
    return facts


async def sample_running(address: str, samples: list[int], stop: asyncio.Event) -> None:
    """The scheduler's running count every 200 ms (the served batch) until stop is set."""
    import grpc

    from planserve.v1 import generate_pb2, generate_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        while not stop.is_set():
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                status = await stub.GetServerStatus(
                    generate_pb2.GetServerStatusRequest(), timeout=5
                )
                samples.append(int(status.num_running))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


def forward_per_step(before: dict[str, float], after: dict[str, float], elapsed: float) -> dict:
    """The steps the model service ran between two scrapes of /metrics, its forward time a step
    (on CUDA timed by events around the forward alone) and the run's wall time a step: the
    difference is the time a step the forward did not run (sampling and both services' host
    work between one forward and the next)."""
    count, total = (f"{FORWARD}_count", f"{FORWARD}_sum")
    steps = after.get(count, 0.0) - before.get(count, 0.0)
    if not steps:
        return {"steps": 0}
    forward_ms = 1e3 * (after.get(total, 0.0) - before.get(total, 0.0)) / steps
    wall_ms = 1e3 * elapsed / steps
    return {"steps": int(steps), "forward_ms_per_step": round(forward_ms, 3),
            "wall_ms_per_step": round(wall_ms, 3),
            "not_forward_ms_per_step": round(wall_ms - forward_ms, 3)}  # fmt: skip


async def measure_serving(address: str, server: Serve, requests, args) -> dict:
    """The workload against a serving server, with the meters running around it."""
    from bench.load import report, scrape

    metrics_url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    serve_pid = server.process.pid

    gpu, cpu, stop = GpuMonitor(args.device), CpuMeter(serve_pid), asyncio.Event()
    running: list[int] = []
    sampler = None

    loop = asyncio.get_running_loop()

    def sample() -> None:
        nonlocal sampler
        sampler = asyncio.ensure_future(sample_running(address, running, stop))

    def started() -> None:  # on this loop or a timer thread (send_workload)
        gpu.start()
        loop.call_soon_threadsafe(sample)

    before = await asyncio.to_thread(scrape.samples, metrics_url)
    # The services' CPU seconds from before the clients start (they idle until the first request)
    # over the run's wall time: a window that cannot miss the run however late `started` runs.
    cpu.start()
    results, elapsed, client_percent = await send_workload(
        address,
        requests,
        args.client_processes,
        max(1.0, phase_limit(args)),
        started,
        sampling(args),
    )
    after = await asyncio.to_thread(scrape.samples, metrics_url)
    cpu_percent = {**cpu.stop(wall=elapsed), "clients": client_percent}
    stop.set()
    if sampler is not None:
        await sampler
    gpu_stats = gpu.stop()
    summary = report.summarize(results, elapsed)
    busy = [n for n in running if n > 0]
    # The client's view of the batch: streams between their first and last token, over the run.
    decoding = sum(r.end_s - r.chunk_times_s[0] for r in results if r.chunk_times_s)
    streamed = sum(r.output_tokens for r in results)
    return {
        **summary,
        "decoding_streams_mean": round(decoding / elapsed, 1) if elapsed > 0 else None,
        # Every token streamed, cut-off requests' too: the rate of a run stopped at its limit.
        "streamed_tokens_per_s": round(streamed / elapsed, 1) if elapsed > 0 else None,
        "expected_output_tokens": sum(r.max_new_tokens for r in requests),
        "gpu": gpu_stats,
        "cpu_percent": cpu_percent,
        "engine": forward_per_step(before, after, elapsed),
        "running": {**(percentiles(busy) or {}), "max": max(busy, default=0), "samples": len(busy)},
    }


async def serve_phase(shape: str, requests, args, log_path: str) -> dict:
    server = Serve(shape, args, log_path)
    start = time.perf_counter()
    try:
        address = await server.start(max(1.0, phase_limit(args)))
        started_s = round(time.perf_counter() - start, 2)
        progress(f"{shape}: serving on {address} after {started_s} s; sending the workload")
        facts = await describe(f"127.0.0.1:{server.engine_port}")
        result = await measure_serving(address, server, requests, args)
    finally:
        await server.stop()
    result["engine"]["launched_ahead"] = launched_ahead(log_path)
    return {"startup_s": started_s, "argv": server.argv[1:], "describe": facts, **result}


def launched_ahead(log_path: str) -> int | None:
    """The steps the model service launched behind a step in flight (model_service/step/
    launch_ahead.py), as its Execute stream's closing line logged them; None if not logged."""
    found = None
    if not os.path.exists(log_path):
        return None
    with open(log_path, errors="replace") as log:
        for line in log:
            if "execute_stream_closed" in line:
                match = re.search(r"launched_ahead\W+(\d+)", line)
                found = int(match.group(1)) if match else found
    return found


def child_phase(module: str, argv: list[str], out: str, args, log_path: str) -> dict:
    """`python -m module ARGV --out OUT` within --max-seconds; its JSON (what it wrote so far,
    when stopped) with the reason it stopped early, if it did."""
    error, limit = None, max(1.0, phase_limit(args))
    with open(log_path, "ab") as log:
        try:
            done = subprocess.run([sys.executable, "-m", module, *argv, "--out", out],
                                  stdout=log, stderr=log, env=child_env(), cwd=ROOT,
                                  timeout=limit)  # fmt: skip
            error = None if done.returncode == 0 else f"exit status {done.returncode}"
        except subprocess.TimeoutExpired:
            error = f"stopped after {limit:.0f} s"
    result = {}
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    return {**result, "error": error, "log": log_path}


def sampling(args) -> dict:
    """How the served requests sample (the clients' GrpcBackend arguments)."""
    return {"temperature": args.temperature, "top_p": args.top_p}


def mean_context(requests) -> int:
    """A decoding sequence's mean context over the run: its prompt and half its new tokens."""
    total = sum(len(r.prompt_ids) + r.max_new_tokens / 2 for r in requests)
    return round(total / len(requests))


def over_budget(entry: dict, phase: str, shape: str, args) -> bool:
    """True (and the phase recorded as skipped) when --budget-seconds leaves under 20 s."""
    if phase_limit(args) >= 20:
        return False
    entry[phase] = {"skipped": f"--budget-seconds {args.budget_seconds:.0f} spent"}
    progress(f"{shape}: {phase} skipped, the budget is spent")
    return True


def run_shape(shape: str, requests, args, work: str) -> Iterator[dict]:
    """serve, then ceiling, then transformers for one shape; each phase's result as it ends."""
    entry: dict = {}
    log = os.path.join(args.log_dir, f"{shape}.log")
    if over_budget(entry, "serve", shape, args):
        yield entry
        return
    progress(f"{shape}: starting planserve serve (log {log})")
    try:
        entry["serve"] = asyncio.run(serve_phase(shape, requests, args, log))
    except Exception as error:  # recorded: the other phases and shapes still run
        entry["serve"] = {"error": repr(error)[:500], "log": log}
    serve = entry["serve"]
    progress(f"{shape}: served {serve.get('output_tokens_per_s')} output tok/s, "
             f"ITL p50 {serve.get('itl_ms', {}).get('p50')} ms")  # fmt: skip
    yield entry
    if not args.no_ceiling and over_budget(entry, "ceiling", shape, args):
        yield entry
    elif not args.no_ceiling:
        batch = round(
            (serve.get("running") or {}).get("mean") or serve.get("decoding_streams_mean") or 1
        )
        argv = ["--shape", shape, "--device", args.device, "--dtype", args.ceiling_dtype,
                "--batch", str(batch), "--context", str(mean_context(requests))]  # fmt: skip
        progress(f"{shape}: ceiling at batch {batch}")
        out = os.path.join(work, f"{shape}.ceiling.json")
        entry["ceiling"] = child_phase("bench.gpu.ceiling", argv, out, args, log)
        progress(f"{shape}: ceiling {entry['ceiling'].get('ceiling_tokens_per_s')} tok/s, "
                 f"graph {entry['ceiling'].get('graph_ms')} ms, "
                 f"floor {entry['ceiling'].get('floor_ms')} ms "
                 f"(serial {entry['ceiling'].get('serial_floor_ms')} ms)")  # fmt: skip
        yield entry
    if not args.no_transformers and over_budget(entry, "transformers", shape, args):
        yield entry
    elif not args.no_transformers:
        argv = ["--shape", shape, "--device", args.device, "--dtype", args.ceiling_dtype,
                "--workload", args.workload, "--batch-size", str(args.hf_batch_size),
                "--max-seconds", str(0.7 * phase_limit(args))]  # fmt: skip
        progress(f"{shape}: transformers, static batches of {args.hf_batch_size}")
        out = os.path.join(work, f"{shape}.transformers.json")
        entry["transformers"] = child_phase("bench.gpu.hf_static", argv, out, args, log)
        progress(f"{shape}: transformers {entry['transformers'].get('output_tokens_per_s')} tok/s")
        yield entry


def write(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto", help="the served dtype (auto: bf16 on a GPU)")
    parser.add_argument("--workload", default="big")
    parser.add_argument("--max-seconds", type=float, default=90.0, help="per phase")
    parser.add_argument("--budget-seconds", type=float, default=340.0,
                        help="the whole run: later phases are cut short, then skipped")  # fmt: skip
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-ceiling", action="store_true")
    parser.add_argument("--hf-batch-size", type=int, default=256)
    parser.add_argument("--serve-flags", default="", help="more `planserve serve` flags")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="above 0: every request samples, seeded, with --top-p (the "
        "sampler's cost on the device; the ceiling and transformers stay greedy)",
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--client-processes", type=int, default=4,
                        help="processes sending the workload (1: this one)")  # fmt: skip
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--log-dir", default=None, help="default: a new temporary folder")
    dry = "the CPU check: tiny shape, 16 requests of 8 tokens, --device cpu"
    parser.add_argument("--dry-run", action="store_true", help=dry)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.shapes, args.device, args.workload, args.dtype = "tiny", "cpu", "dry", "float32"
        args.serve_flags = args.serve_flags or "--num-kv-blocks 2048"  # not the CPU's 1 GiB
    args.ceiling_dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="gpu-serve-logs-")
    os.makedirs(args.log_dir, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    requests = workload_requests(args.workload)
    report = {
        "command": [os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])],
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "finished": None,
        "machine": machine(args.device, child_env()),
        "workload": {
            "name": args.workload,
            "requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
            "output_tokens": sum(r.max_new_tokens for r in requests),
        },  # fmt: skip
        "max_seconds_per_phase": args.max_seconds,
        "budget_seconds": args.budget_seconds,
        "serve_flags": args.serve_flags,
        "sampling": sampling(args),
        "log_dir": args.log_dir,
        "shapes": {},
    }
    progress(f"{report['machine'].get('gpu') or report['machine']['cpu']}; logs in {args.log_dir}")
    with tempfile.TemporaryDirectory(prefix="gpu-serve-") as work:
        for shape in args.shapes.split(","):
            for entry in run_shape(shape, requests, args, work):
                report["shapes"][shape] = entry
                write(report, args.out)
    report["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write(report, args.out)
    progress(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
