"""The model service's OpenMP thread settings (and its decoder loop), tried on the peer workload
through `planserve serve` on a quiet machine and on a loaded one. A plain script, not a test; ~1
minute a setting and machine on 2 cores.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_threads.py [--settings NAME ...] [--label TEXT]

Each setting is an environment given to `planserve serve` (its model service inherits it, and
sets it up before torch loads libgomp); whatever a setting leaves out is the model service's
default (model_service/threads.py). Machines:
    quiet    nothing else running; starts once the load average is under 0.5 (or after 150 s),
             and records it
    loaded   one extra process spinning on one core for the whole run
Per run: the peer workload's output tokens/s (16 prompts of 32..512 tokens, 128 greedy tokens,
all sent at once, after one warm-up request), the inter-token latency p50 the client sees, and
the model service's own forward time per step (p50 of planserve_model_forward_seconds, read from
/metrics: most steps of this workload are decodes of all 16 sequences). Results:
bench/results/threads.json under --label.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import measure  # noqa: E402
from bench.load import report, scrape, workloads  # noqa: E402
from bench.load.loadgen import GrpcBackend, run_workload  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT = os.path.join(ROOT, "bench", "results", "threads.json")
PORT, METRICS_PORT = 18421, 18422
# libgomp's own defaults, spelled out so a setting does not inherit the model service's choice:
# OMP_WAIT_POLICY unset = spin GOMP_SPINCOUNT = 300,000 times before sleeping.
SETTINGS = {
    "spin (libgomp default)": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "300000", "OMP_NUM_THREADS": "2"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "", "OMP_NUM_THREADS": "2"},
    "short spin (10k)": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "10000", "OMP_NUM_THREADS": "2"},
    "1 thread": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "", "OMP_NUM_THREADS": "1"},
    "spin, threads bound to cores": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "300000", "OMP_NUM_THREADS": "2",
                                     "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "service default": {},
    # Not a thread setting: the Python loop over the layers (nine native calls a layer, each
    # retaking the GIL) against the default native loop, under the same two machines.
    "service default, Python decoder loop": {"PLANSERVE_DECODER_LOOP": "python"},
}


def _env(setting: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT]))
    for key, value in setting.items():
        env[key] = value  # "" = unset for libgomp's purposes but still overrides the service default
    return env


def _forward_p50_ms() -> float | None:
    """Median of the forward-time histogram, interpolated inside its bucket."""
    found = scrape.samples(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout_s=10)
    p50 = scrape.quantile(found, "planserve_model_forward_seconds", 0.5)
    return None if p50 is None else 1e3 * p50


async def _peer_run(setting: dict, log) -> dict:
    argv = [sys.executable, "-m", "tools", "serve", "--port", str(PORT), "--engine-port", "0",
            "--http-port", "-1", "--metrics-port", str(METRICS_PORT)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=_env(setting), cwd=ROOT,
                               start_new_session=True)
    try:
        for line in process.stdout:
            if line.startswith("PLANSERVE_PORT="):
                threading.Thread(target=lambda: [log.write(x) for x in process.stdout], daemon=True).start()
                break
        else:
            raise RuntimeError(f"planserve serve exited with {process.wait()}")
        peer = workloads.load("peer")
        async with GrpcBackend(f"127.0.0.1:{PORT}") as backend:
            await run_workload(backend, [workloads.BenchRequest("warmup", 0.0, peer[0].prompt_ids, 8)], progress=False)

            results, elapsed = await run_workload(backend, peer, progress=False)
        summary = report.summarize(results, elapsed, request_rate=None, workload="peer")
        return {"output_tok_s": summary["output_tokens_per_s"], "itl_p50_ms": summary["itl_ms"]["p50"],
                "itl_p99_ms": summary["itl_ms"]["p99"], "forward_p50_ms": _forward_p50_ms(), "failed": summary["failed"]}
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_for_quiet(below: float = 0.5, timeout_s: float = 150.0) -> None:
    """Until the 1-minute load average is under `below` (the previous run's load decays slowly)."""
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--machines", nargs="+", choices=["quiet", "loaded"], default=["quiet", "loaded"])
    parser.add_argument("--label", default="after")
    args = parser.parse_args()
    run = {"machine": {"cpu": measure.cpu_model(), "cores": os.cpu_count()}, "runs": []}
    log = open(os.path.join(tempfile.gettempdir(), "planserve-bench-threads.log"), "w")  # the servers' stderr
    for machine in args.machines:
        for name in args.settings:
            if machine == "quiet":
                _wait_for_quiet()
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if machine == "loaded" else None
            try:
                load = os.getloadavg()[0]
                result = asyncio.run(_peer_run(SETTINGS[name], log))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            result.update(machine=machine, setting=name, env=SETTINGS[name], load_avg_at_start=round(load, 2))
            if result["forward_p50_ms"] and result["itl_p50_ms"]:
                result["itl_p50_over_forward_p50"] = round(result["itl_p50_ms"] / result["forward_p50_ms"], 3)
            run["runs"].append(result)
            print(f"{machine:6s} {name:24s} {result['output_tok_s']:7.1f} tok/s  ITL p50 {result['itl_p50_ms']:6.1f} ms  "
                  f"forward p50 {result['forward_p50_ms'] or 0:6.1f} ms  (load {load:.2f})", file=sys.stderr, flush=True)
            time.sleep(5)  # let the load average settle a little between runs
    measure.save_run(OUT, args.label, run)
    print(f"wrote {os.path.relpath(OUT)} [{args.label}]", file=sys.stderr)


if __name__ == "__main__":
    main()
