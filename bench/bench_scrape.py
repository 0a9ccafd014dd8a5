"""What a gateway's scrape of /metrics costs the scheduler under load.

The Gateway API Inference Extension's endpoint picker reads /metrics on the serving port every
50 ms. This starts a model service and `planserve scheduler` as their own processes, keeps
`--streams` greedy generations running over gRPC from this process, and reads the scheduler
process's CPU time (/proc, user + system) over alternating windows with and without a scraper
at `--interval-ms`. It also times the scrape alone: `--idle-scrapes` back-to-back scrapes with
the workload stopped, whose CPU per scrape times the scrape rate is the cost without the load's
noise.

    PYTHONPATH=$PWD:protos .venv/bin/python bench/bench_scrape.py --model tiny --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import grpc

from planserve.v1 import generate_pb2, generate_pb2_grpc

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (not its children), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def start(command: list[str], names: tuple[str, ...]) -> tuple[subprocess.Popen, dict[str, int]]:
    """Starts a process and reads the ports it announces (lines `NAME=port`) for `names`."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    ports: dict[str, int] = {}
    assert process.stdout is not None
    for line in process.stdout:
        name, _, value = line.strip().partition("=")
        if name in names:
            ports[name] = int(value)
            if len(ports) == len(names):
                return process, ports
    raise RuntimeError(f"{command[:4]} exited with {process.wait()}")


class Scraper(threading.Thread):
    """GET /metrics every interval on one keep-alive connection, as a picker does."""

    def __init__(self, port: int, interval_s: float):
        super().__init__(daemon=True)
        self.port, self.interval_s = port, interval_s
        self.latencies: list[float] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        next_at = time.monotonic()
        while not self.stopping.is_set():
            started = time.monotonic()
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            self.latencies.append(time.monotonic() - started)
            next_at += self.interval_s
            self.stopping.wait(max(next_at - time.monotonic(), 0))
        connection.close()


async def keep_generating(stub, stop: asyncio.Event, index: int, counter: list[int]) -> None:
    while not stop.is_set():
        request = generate_pb2.GenerateRequest()
        request.token_ids.ids.extend([3 + (index * 7 + i) % 200 for i in range(48)])
        request.sampling.temperature = 0.0
        request.stopping.max_new_tokens = 64
        request.stopping.ignore_eos = True
        async for chunk in stub.Generate(request):
            counter[0] += len(chunk.token_ids)


async def measure(args, scheduler_pid: int, grpc_port: int, http_port: int) -> dict:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = generate_pb2_grpc.GenerationServiceStub(channel)
    stop, tokens = asyncio.Event(), [0]
    workers = [
        asyncio.ensure_future(keep_generating(stub, stop, i, tokens)) for i in range(args.streams)
    ]
    await asyncio.sleep(args.seconds / 2)  # warm up: every histogram and label set filled
    windows: dict[str, list[dict]] = {"no scrape": [], "scrape": []}
    latencies: list[float] = []
    for _ in range(args.rounds):
        for label in ("no scrape", "scrape"):
            scraper = Scraper(http_port, args.interval_ms / 1000) if label == "scrape" else None
            cpu0, tokens0, t0 = cpu_seconds(scheduler_pid), tokens[0], time.monotonic()
            if scraper:
                scraper.start()
            await asyncio.sleep(args.seconds)
            if scraper:
                scraper.stopping.set()
                await asyncio.to_thread(scraper.join)
                latencies += scraper.latencies
            elapsed = time.monotonic() - t0
            windows[label].append(
                {
                    "cpu_per_s": (cpu_seconds(scheduler_pid) - cpu0) / elapsed,
                    "tokens_per_s": (tokens[0] - tokens0) / elapsed,
                }
            )
    stop.set()
    await asyncio.gather(*workers)
    await channel.close()
    return {
        "windows": windows,
        "scrape_latency_ms": {
            "p50": 1000 * statistics.median(latencies),
            "p99": 1000 * statistics.quantiles(latencies, n=100)[98],
            "count": len(latencies),
        },
    }


def idle_cost(scheduler_pid: int, http_port: int, count: int) -> float:
    """CPU seconds of the scheduler per scrape, scrapes back to back with no workload."""
    connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
    cpu0 = cpu_seconds(scheduler_pid)
    for _ in range(count):
        connection.request("GET", "/metrics")
        connection.getresponse().read()
    connection.close()
    return (cpu_seconds(scheduler_pid) - cpu0) / count


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of one window")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--interval-ms", type=float, default=50.0)
    parser.add_argument("--idle-scrapes", type=int, default=2000)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    engine, engine_ports = start(
        [sys.executable, "-m", "model_service", "--port", "0", "--model", args.model],
        ("PLANSERVE_ENGINE_PORT",),
    )
    scheduler = None
    try:
        scheduler, ports = start(
            [
                sys.executable,
                "-m",
                "tools",
                "scheduler",
                "--engine",
                f"127.0.0.1:{engine_ports['PLANSERVE_ENGINE_PORT']}",
                "--port",
                "0",
                "--http-port",
                "0",
                "--metrics-port",
                "-1",
            ],
            ("PLANSERVE_PORT", "PLANSERVE_HTTP_PORT"),
        )
        report = asyncio.run(
            measure(args, scheduler.pid, ports["PLANSERVE_PORT"], ports["PLANSERVE_HTTP_PORT"])
        )
        per_scrape = idle_cost(scheduler.pid, ports["PLANSERVE_HTTP_PORT"], args.idle_scrapes)
        report["idle_cpu_ms_per_scrape"] = 1000 * per_scrape
        report["cost_at_interval_pct_of_a_core"] = 100 * per_scrape * 1000 / args.interval_ms
        report["settings"] = vars(args)
    finally:
        for process in (scheduler, engine):
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
