"""Where the CPU goes while `planserve serve` runs the peer workload: CPU seconds of the scheduler
process, the model service and the client (this process), the model service's busiest threads,
and its forward time per step (the planserve_model_forward_seconds histogram). A plain script, not
a test; ~1 minute on 2 cores, best on a quiet machine.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_serve_cpu.py [--batches 16,64] [NAME=VALUE ...]

NAME=VALUE pairs go into the served processes' environment (e.g. PLANSERVE_DECODER_LOOP=python).

--batches B,...: instead of the peer workload, B requests of one prompt length decoding together
(all sent at t=0), one batch size after another on the same server. Between the moment every
request has its first token (the prompts are done) and the moment the first one ends, every step
is a decode of exactly B sequences; over that window the served step (the client's wall time per
step, and its ITL) is set against the model service's own forward time per step. Their ratio is
what the scheduler, the Execute round trip and the client stream add to a step.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

from bench import measure  # noqa: E402
from bench.load import report, scrape, workloads  # noqa: E402
from bench.load.loadgen import GrpcBackend, RequestResult, run_workload  # noqa: E402

PORT, METRICS_PORT = 18431, 18432
TICKS = os.sysconf("SC_CLK_TCK")
FORWARD = "planserve_model_forward_seconds"
BATCH_PROMPT_TOKENS, BATCH_NEW_TOKENS = 128, 96


def _cpu_seconds(stat_path: str) -> tuple[str, float]:
    """(name, user + system seconds) from a /proc .../stat file."""
    text = open(stat_path).read()
    fields = text.rsplit(")", 1)[1].split()
    return text.split("(", 1)[1].rsplit(")", 1)[0], (int(fields[11]) + int(fields[12])) / TICKS


def _threads(pid: int) -> dict[str, float]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, seconds = _cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:  # the thread ended
            continue
        out[f"{name}:{tid}"] = seconds
    return out


def _forward_metrics() -> dict[str, float]:
    return scrape.samples(f"http://127.0.0.1:{METRICS_PORT}/metrics")


def _serve(env_extra: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """`planserve serve` on the default model; (its process, the model service's pid)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT]), **env_extra)
    serve = subprocess.Popen([sys.executable, "-m", "tools", "serve", "--port", str(PORT), "--engine-port", "0",
                              "--http-port", "-1", "--metrics-port", str(METRICS_PORT)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
                             start_new_session=True)
    for line in serve.stdout:
        if line.startswith("PLANSERVE_PORT="):
            threading.Thread(target=lambda: [None for _ in serve.stdout], daemon=True).start()
            break
    else:
        raise RuntimeError(f"planserve serve exited with {serve.wait()}")
    model = int(subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True, text=True).stdout.split()[0])
    return serve, model


async def _peer(backend: GrpcBackend, serve: subprocess.Popen, model: int, env_extra: dict[str, str]) -> None:
    peer = workloads.load("peer")
    before = (_cpu_seconds(f"/proc/{serve.pid}/stat")[1], _cpu_seconds(f"/proc/{model}/stat")[1],
              resource.getrusage(resource.RUSAGE_SELF), _threads(model), _forward_metrics())
    start = time.perf_counter()
    results, elapsed = await run_workload(backend, peer, progress=False)
    wall = time.perf_counter() - start
    after = (_cpu_seconds(f"/proc/{serve.pid}/stat")[1], _cpu_seconds(f"/proc/{model}/stat")[1],
             resource.getrusage(resource.RUSAGE_SELF), _threads(model), _forward_metrics())
    summary = report.summarize(results, elapsed, request_rate=None, workload="peer")
    client = sum(getattr(after[2], f) - getattr(before[2], f) for f in ("ru_utime", "ru_stime"))
    steps = after[4][f"{FORWARD}_count"] - before[4][f"{FORWARD}_count"]
    forward = after[4][f"{FORWARD}_sum"] - before[4][f"{FORWARD}_sum"]
    print(f"{measure.cpu_model()}, {os.cpu_count()} cores; env {env_extra or '(service defaults)'}")
    print(f"peer workload: {summary['output_tokens_per_s']:.1f} output tok/s, {wall:.2f} s, {steps:.0f} steps, "
          f"forward {forward:.2f} s (mean {1e3 * forward / steps:.1f} ms)")
    print(f"CPU seconds: scheduler {after[0] - before[0]:.2f}, model service {after[1] - before[1]:.2f}, "
          f"client {client:.2f} (cores x wall = {os.cpu_count() * wall:.2f})")
    busiest = sorted(after[3], key=lambda t: before[3].get(t, 0) - after[3][t])[:4]
    print("model service threads: " + ", ".join(f"{t} {after[3][t] - before[3].get(t, 0):.2f}" for t in busiest))
    print("forward time per step (steps at or below each bound):")
    below = 0
    for key, count in after[4].items():
        if key.endswith("_bucket") or "_bucket{" in key:
            steps_here = count - before[4].get(key, 0) - below
            if steps_here:
                print(f"  <= {key.split('le=')[1].strip('}').strip(chr(34))} s: {steps_here:.0f}")
            below += steps_here


async def _batch(backend: GrpcBackend, size: int, rng: random.Random) -> dict:
    """One batch of `size` requests: the served decode step against the forward (module doc)."""
    requests = [workloads.BenchRequest(f"b{size}-{i}", 0.0, [rng.randrange(1000, 40000) for _ in
                                       range(BATCH_PROMPT_TOKENS)], BATCH_NEW_TOKENS) for i in range(size)]
    results = [RequestResult(r.id, BATCH_PROMPT_TOKENS, BATCH_NEW_TOKENS) for r in requests]
    start = time.perf_counter()
    sends = asyncio.gather(*(backend.send(r, results[i], start, i) for i, r in enumerate(requests)))
    while not all(r.chunk_times_s for r in results):
        await asyncio.sleep(0.0005)
    begin = time.perf_counter() - start, await asyncio.to_thread(_forward_metrics)
    while not any(r.end_s for r in results):
        await asyncio.sleep(0.0005)
    end = time.perf_counter() - start, await asyncio.to_thread(_forward_metrics)
    await sends
    steps = end[1][f"{FORWARD}_count"] - begin[1][f"{FORWARD}_count"]
    forward_ms = 1e3 * (end[1][f"{FORWARD}_sum"] - begin[1][f"{FORWARD}_sum"]) / steps
    gaps = [b - a for r in results for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])
            if begin[0] <= a and b <= end[0]]
    wall_ms = 1e3 * (end[0] - begin[0]) / steps
    return {"batch": size, "decode_steps": int(steps), "forward_ms": round(forward_ms, 2),
            "served_step_ms": round(wall_ms, 2), "itl_p50_ms": round(1e3 * statistics.median(gaps), 2),
            "served_over_forward": round(wall_ms / forward_ms, 3)}


async def _run(batches: list[int], env_extra: dict[str, str]) -> None:
    serve, model = _serve(env_extra)
    try:
        async with GrpcBackend(f"127.0.0.1:{PORT}") as backend:
            peer = workloads.load("peer")
            await run_workload(backend, [workloads.BenchRequest("warmup", 0.0, peer[0].prompt_ids, 8)],
                               progress=False)
            if not batches:
                await _peer(backend, serve, model, env_extra)
                return
            print(f"{measure.cpu_model()}, {os.cpu_count()} cores; env {env_extra or '(service defaults)'}; "
                  f"prompts {BATCH_PROMPT_TOKENS}, {BATCH_NEW_TOKENS} new tokens; load {os.getloadavg()[0]:.2f}")
            rng = random.Random(0)
            for size in batches:
                print(await _batch(backend, size, rng), flush=True)
    finally:
        serve.terminate()
        serve.wait(20)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="", help="batch sizes, e.g. 16,64 (none: the peer workload)")
    parser.add_argument("env", nargs="*", help="NAME=VALUE for the served processes")
    args = parser.parse_args()
    asyncio.run(_run([int(b) for b in args.batches.split(",") if b], dict(a.split("=", 1) for a in args.env)))
