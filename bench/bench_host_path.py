"""The host path of a step, whole: `planserve serve --model null --null-step-delay-ms D` (the
null model standing in for a GPU whose step takes D ms), N concurrent streams of T tokens at t=0,
read by clients in this process (or, with --client-procs, in child processes), and per step:

  cpu_ms_per_step   CPU time (user + system, all threads) of every server process: the
                    scheduler process (`planserve serve` itself: doors + scheduler loop; with
                    --frontend-processes N the scheduler loop alone, each frontend process its
                    own row) and the model service child, measured from /proc over the timed run
  step_ms           wall time per step (the client's inter-chunk time per token, median)
  tokens/s          output tokens of the timed run over its wall time
  engine_steps      the steps the model service ran (planserve_steps_total on /metrics, before
                    and after), and the sequences they carried on average: the streams start
                    over many steps while their requests arrive, so a run of T tokens takes
                    more than T steps of fewer than N sequences each
  cpu_ms_per_engine_step  each process's CPU over those steps (the figures above count T)

for each API (gRPC Generate, gRPC Session, the OpenAI HTTP API with SSE) and stream_interval.
The goal's "step" is a token's step: figures are divided by T (a stream of T tokens takes T
decode steps; its prefill step gives the first token). The load average is recorded beside them: CPU per
step is what a loaded machine disturbs least.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_host_path.py \\
        [--streams 256] [--tokens 128] [--delay-ms 4] [--apis generate,session,http] \\
        [--intervals 1,8] [--profile bench/results/host_path.prof]

--grpc-floor measures only a bare grpc.aio server streaming the same number of tiny chunks (no
planserve code): the least a chunk costs. --profile runs the scheduler process under cProfile
(the figures of that run are inflated by the profiler; use it to see where the time goes, not
for the figures). Writes bench/results/host_path.json (--out) unless --no-write.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos")]

import grpc  # noqa: E402

from bench.load import scrape  # noqa: E402
from planserve.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402

PROMPT_LEN = 64
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ")


def _server_processes(root: int) -> dict[str, int]:
    """Name -> pid of the server's process tree: the model service child named by its module,
    each frontend process (--frontend-processes) as frontend_0, frontend_1, ..."""
    processes = {"scheduler_process": root}
    pending = [root]
    num_frontends = 0
    while pending:
        for child in _children(pending.pop()):
            cmdline = _cmdline(child)
            if "model_service" in cmdline:
                name = "model_service"
            elif "scheduler_service.frontends" in cmdline:
                name, num_frontends = f"frontend_{num_frontends}", num_frontends + 1
            else:
                name = f"child_{child}"
            processes[name] = child
            pending.append(child)
    return processes


def _prompt(i: int) -> list[int]:
    return [32 + (i * 7 + j) % 90 for j in range(PROMPT_LEN)]


class Server:
    def __init__(self, args, profile: str | None):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT]))
        prefix = [sys.executable] + (["-m", "cProfile", "-o", profile] if profile else [])
        n = str(args.streams)
        command = prefix + [
            "-m", "tools", "serve", "--model", "null", "--null-step-delay-ms", str(args.delay_ms),
            "--port", "0", "--engine-port", "0", "--http-port", "0", "--metrics-port", "-1",
            "--max-num-seqs", n, "--max-num-slots", n,
            "--max-stream-buffer-chunks", str(args.stream_buffer),
            "--max-queue-len", str(4 * args.streams),
            "--max-num-batched-tokens", str(max(8192, PROMPT_LEN * args.streams)),
            "--frontend-processes", str(args.frontend_processes),
            *shlex.split(args.serve_flags),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, env=env)
        ports = {}
        for line in self.process.stdout:
            if line.startswith("PLANSERVE_PORT="):
                ports["grpc"] = int(line.split("=", 1)[1])
            elif line.startswith("PLANSERVE_HTTP_PORT="):
                ports["http"] = int(line.split("=", 1)[1])
                break
        else:
            raise RuntimeError(f"planserve serve exited with {self.process.wait()}")
        # Read stdout to the end in the background: a full pipe would block the server.
        threading.Thread(target=self.process.stdout.read, daemon=True).start()
        self.grpc_port, self.http_port = ports["grpc"], ports["http"]
        self.pids = _server_processes(self.process.pid)
        if len([n for n in self.pids if n.startswith("frontend_")]) != args.frontend_processes:
            raise RuntimeError(f"expected {args.frontend_processes} frontends: {self.pids}")

    def cpu(self) -> dict[str, float]:
        return {name: _cpu_s(pid) for name, pid in self.pids.items()}

    def stop(self) -> None:
        self.process.terminate()  # a drain, then exit 0 (cProfile writes its file then)
        self.process.wait(timeout=60)


def generate_request(i: int, tokens: int, interval: int, tag: str) -> generate_pb2.GenerateRequest:
    """Stream i's greedy Generate of `tokens` tokens (no eos) after its 64-token prompt (with
    its tokens' logprobs and two alternatives each for the first --logprobs-streams, frequency
    and presence penalties for the first --penalty-streams)."""
    request = generate_pb2.GenerateRequest(request_id=f"{tag}-{i}")
    if i < LOGPROB_STREAMS[0]:
        request.logprobs, request.top_logprobs = True, 2
    if i < PENALTY_STREAMS[0]:
        request.sampling.frequency_penalty, request.sampling.presence_penalty = 0.5, 0.25
    request.token_ids.ids.extend(_prompt(i))
    request.sampling.temperature = 0.0
    request.stopping.max_new_tokens = tokens
    request.stopping.ignore_eos = True
    if interval != 1:
        request.stream_interval = interval
    return request


# gRPC connections the Generate streams are spread over (--channels): the kernel hands each
# connection to one frontend process (SO_REUSEPORT), so one connection would load only one.
NUM_CHANNELS = [1]
# Streams that ask for logprobs (--logprobs-streams): the first ones of each run.
LOGPROB_STREAMS = [0]
# Streams with frequency and presence penalties (--penalty-streams): the first ones of each run.
PENALTY_STREAMS = [0]


async def run_generate(port: int, n: int, tokens: int, interval: int, tag: str) -> list:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(NUM_CHANNELS[0])]
    stubs = [generate_pb2_grpc.GenerationServiceStub(c) for c in channels]

    async def one(i: int):
        times, counts = [], []
        request = generate_request(i, tokens, interval, tag)
        async for chunk in stubs[i % len(stubs)].Generate(request):
            if chunk.token_ids:
                times.append(time.perf_counter())
                counts.append(len(chunk.token_ids))
        return times, counts

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await asyncio.gather(*(c.close() for c in channels))


async def run_session(port: int, n: int, tokens: int, interval: int, tag: str) -> list:
    """All n requests on one Session stream (what a sidecar neighbour does)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        messages = [generate_pb2.SessionRequest(generate=generate_request(i, tokens, interval, tag))
                    for i in range(n)]
        call = stub.Session(iter(messages))
        runs = {f"{tag}-{i}": ([], []) for i in range(n)}
        async for response in call:
            chunk = response.chunk
            if chunk.token_ids:
                times, counts = runs[chunk.request_id]
                times.append(time.perf_counter())
                counts.append(len(chunk.token_ids))
        return list(runs.values())


async def run_http(port: int, n: int, tokens: int, interval: int, tag: str) -> list:
    """OpenAI completions with stream=true over raw HTTP/1.1 (no client library in the way)."""

    async def one(i: int):
        body = json.dumps({"model": "null", "prompt": _prompt(i), "max_tokens": tokens,
                           "temperature": 0.0, "ignore_eos": True, "stream": True,
                           **({"logprobs": 2} if i < LOGPROB_STREAMS[0] else {}),
                           **({"frequency_penalty": 0.5, "presence_penalty": 0.25}
                              if i < PENALTY_STREAMS[0] else {}),
                           **({"stream_interval": interval} if interval != 1 else {})}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        times, counts = [], []
        async for line in reader:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
                counts.append(1)  # an SSE event per chunk; tokens are counted by the server
        writer.close()
        return times, counts

    return await asyncio.gather(*(one(i) for i in range(n)))


class _BareServicer(generate_pb2_grpc.GenerationServiceServicer):
    """The floor: a Generate that streams `max_new_tokens` tiny chunks and nothing else."""

    async def Generate(self, request, context):
        for _ in range(request.stopping.max_new_tokens):
            yield generate_pb2.GenerateResponse(request_id=request.request_id, token_ids=[97],
                                                text="a")
            await asyncio.sleep(0)


def _serve_bare(port_out) -> None:
    async def serve():
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServiceServicer_to_server(_BareServicer(), server)
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def grpc_floor(args) -> dict:
    """Server CPU per streamed message of a bare grpc.aio server (no planserve code): what one
    chunk costs at the least, for the same streams and tokens."""
    import multiprocessing

    port_out = multiprocessing.Queue()
    child = multiprocessing.Process(target=_serve_bare, args=(port_out,), daemon=True)
    child.start()
    port = port_out.get(timeout=60)
    try:
        asyncio.run(run_generate(port, args.streams, 4, 1, "warm"))
        cpu0 = _cpu_s(child.pid)
        asyncio.run(run_generate(port, args.streams, args.tokens, 1, "floor"))
        per_message_us = (_cpu_s(child.pid) - cpu0) * 1e6 / (args.streams * args.tokens)
    finally:
        child.kill()
    return {"server_cpu_us_per_message": round(per_message_us, 2),
            "server_cpu_ms_per_step": round(per_message_us * args.streams / 1000, 3),
            "streams": args.streams, "loadavg": [round(x, 2) for x in os.getloadavg()]}


RUNNERS = {"generate": run_generate, "session": run_session, "http": run_http}


async def measure(server: Server, api: str, args, interval: int) -> dict:
    port = server.http_port if api == "http" else server.grpc_port
    run = RUNNERS[api]
    await run(port, args.streams, 4, interval, f"warm-{api}-{interval}")
    counts0 = await asyncio.to_thread(_engine_counts, server.http_port)
    before, client0, start = server.cpu(), time.process_time(), time.perf_counter()
    runs = await run(port, args.streams, args.tokens, interval, f"{api}-{interval}")
    wall = time.perf_counter() - start
    after, client = server.cpu(), time.process_time() - client0
    counts = await asyncio.to_thread(_engine_counts, server.http_port)
    engine_steps = counts[0] - counts0[0]
    steps = args.tokens
    gaps = [(t[-1] - t[0]) / max(len(t) - 1, 1) / interval for t, _ in runs if len(t) > 1]
    cpu = {name: round((after[name] - before[name]) * 1000 / steps, 3) for name in before}
    cpu["client_process"] = round(client * 1000 / steps, 3)
    per_engine_step = {
        name: round(value * steps / engine_steps, 3) for name, value in cpu.items()
    } if engine_steps else {}
    return {
        "api": api,
        "streams": args.streams,
        "stream_interval": interval,
        "tokens_each": args.tokens,
        "delay_ms": args.delay_ms,
        "frontend_processes": args.frontend_processes,
        "grpc_channels": NUM_CHANNELS[0],
        "logprobs_streams": LOGPROB_STREAMS[0],
        "penalty_streams": PENALTY_STREAMS[0],
        "output_tokens_per_s": round(args.streams * args.tokens / wall, 1),
        "step_ms": round(statistics.median(gaps) * 1000, 3) if gaps else None,
        "chunks_per_stream": statistics.median(len(t) for t, _ in runs),
        "cpu_ms_per_step": cpu,
        "engine_steps": engine_steps,
        "sequences_per_engine_step": round((counts[1] - counts0[1]) / engine_steps, 1)
        if engine_steps else None,
        "cpu_ms_per_engine_step": per_engine_step,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def _engine_counts(http_port: int) -> tuple[float, float]:
    """(steps the model service ran, output tokens) so far, from the serving port's /metrics
    (a decode step gives each of its sequences one token)."""
    found = scrape.samples(f"http://127.0.0.1:{http_port}/metrics")
    return found.get("planserve_steps_total", 0.0), found.get("vllm:generation_tokens_total", 0.0)


async def main_async(args) -> list[dict]:
    rows = []
    server = Server(args, args.profile)
    try:
        for api in args.apis.split(","):
            for interval in (int(x) for x in args.intervals.split(",")):
                row = await measure(server, api, args, interval)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--delay-ms", type=float, default=4.0)
    parser.add_argument("--apis", default="generate,session,http")
    parser.add_argument("--intervals", default="1,8")
    parser.add_argument("--stream-buffer", type=int, default=1 << 20,
                        help="--max-stream-buffer-chunks (main cba8162 counted a Session's "
                        "chunks of all its requests together)")
    parser.add_argument("--frontend-processes", type=int, default=0,
                        help="serve with --frontend-processes N (each one's CPU is its own row)")
    parser.add_argument("--channels", type=int, default=None,
                        help="gRPC connections the Generate streams use (default: 1, or 16 "
                        "with frontend processes, so that the kernel spreads them)")
    parser.add_argument("--serve-flags", default="",
                        help="more `planserve serve` flags, e.g. \"--cuda-graphs eager "
                        "--launch-ahead on\" (the null model's delay then queued as a GPU's)")
    parser.add_argument("--logprobs-streams", type=int, default=0,
                        help="the first K streams ask for their tokens' logprobs (2 alternatives)")
    parser.add_argument("--penalty-streams", type=int, default=0,
                        help="the first K streams ask for frequency and presence penalties")
    parser.add_argument("--profile", default=None, help="cProfile the scheduler process here")
    parser.add_argument("--label", default="", help="what this run measures (before/after ...)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "host_path.json"))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--grpc-floor", action="store_true",
                        help="only the floor: a bare grpc.aio server's CPU per streamed message")
    args = parser.parse_args()
    NUM_CHANNELS[0] = args.channels or (16 if args.frontend_processes else 1)
    LOGPROB_STREAMS[0] = args.logprobs_streams
    PENALTY_STREAMS[0] = args.penalty_streams
    load_before = os.getloadavg()
    if args.grpc_floor:
        print(json.dumps(grpc_floor(args)))
        return
    rows = asyncio.run(main_async(args))
    if args.no_write or args.profile:
        return
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    results.setdefault("runs", []).append({
        "label": args.label,
        "serve_flags": args.serve_flags,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "cpu": platform.processor() or platform.machine(),
                    "loadavg_before": [round(x, 2) for x in load_before]},
        "rows": rows,
    })
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
