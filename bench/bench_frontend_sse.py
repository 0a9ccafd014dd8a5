"""A frontend process's own work per decode step for streamed OpenAI completions (SSE), in one
process: the real HTTP server (uvicorn, Starlette, the OpenAI door) on 127.0.0.1 over a
RemoteEngine, no engine core and no model; the clients read in a child process, so the CPU
measured is the frontend's alone.

N completions with stream=true (64-token prompts, no stop strings: the frontend makes their
text) are admitted through the HTTP door. Each step is what a frontend does with one step message
from the core: unpickle it, hand every stream its output (RemoteEngine.on_step: detokenize,
deliver), and let the loop run until every stream's chunk is written. Prints the median and mean
process CPU a step and per output, with the direct SSE writes off and on (api/sse_direct.py),
and the CPU to admit a stream (its request read, checked and placed, its response's head) and to
end it (its last chunk, usage and [DONE], the connection closed).

    PYTHONPATH=protos:. .venv/bin/python bench/bench_frontend_sse.py [--streams 128] \\
        [--steps 400] [--direct off,on] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import selectors
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos"), os.path.join(ROOT, "tests", "scheduler")]

from bench.bench_frontend_step import frontend  # noqa: E402
from bench.bench_host_path import _prompt  # noqa: E402
from cython_ext.step_outputs import compact_outputs  # noqa: E402
from scheduler_service import heap  # noqa: E402
from scheduler_service.api.http_server import HttpServer  # noqa: E402
from scheduler_service.api.sse_direct import DirectSse  # noqa: E402
from scheduler_service.config import SchedulerConfig  # noqa: E402
from scheduler_service.core.request import FinishReason, RequestOutput, Usage  # noqa: E402


def read_clients(port: int, streams: int, tokens: int) -> None:
    """The child: opens the streams, then reads and drops what comes until every one ends."""
    selector = selectors.DefaultSelector()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    for i, sock in enumerate(socks):  # connected first, so that the requests come at once
        body = json.dumps({"model": "fake", "prompt": _prompt(i), "max_tokens": tokens,
                           "temperature": 0.0, "ignore_eos": True, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    while selector.get_map():
        for key, _ in selector.select():
            try:
                data = key.fileobj.recv(1 << 16)
            except ConnectionError:
                data = b""
            if not data:
                selector.unregister(key.fileobj)
                key.fileobj.close()


def _settled(requests) -> bool:
    """Every stream wrote what it was given: its task waits on an empty queue, nothing held."""
    for request in requests:
        outputs = request.outputs
        if not outputs.empty() or not outputs._getters:
            return False
        if isinstance(outputs, DirectSse) and outputs._pending:
            return False
    return True


async def run(streams: int, steps: int, direct: bool) -> tuple[list[float], float, float]:
    """The CPU of each step, of admitting the streams and of ending them (seconds)."""
    link, status, engine, admission = frontend(max_model_len=64 + steps + 64)
    server = HttpServer(admission, "127.0.0.1", 0, config=SchedulerConfig(
        no_sse_direct_writes=not direct))
    port = await server.start()
    heap.freeze_startup_heap()  # as a frontend process does once it serves
    start = time.process_time()
    clients = subprocess.Popen([sys.executable, __file__, "--read", str(port), str(streams),
                                str(steps + 1)])
    try:
        while len(link.added) < streams or not _settled(engine.requests.values()):
            await asyncio.sleep(0.005)
        admit_cpu = time.process_time() - start
        ids = list(link.added)
        requests = [engine.requests[request_id] for request_id in ids]
        cpu_per_step = []
        for step in range(steps):
            batch = [(request_id, RequestOutput([40 + (step + n) % 50], "")) for n, request_id
                     in enumerate(ids)]
            body = pickle.dumps(("step", compact_outputs(batch), status),
                                pickle.HIGHEST_PROTOCOL)
            start = time.process_time()
            message = pickle.loads(body)
            engine.on_step(message[1], message[2])
            await asyncio.sleep(0)
            while not _settled(requests):
                await asyncio.sleep(0)
            cpu_per_step.append(time.process_time() - start)
            # The clients read between steps, as they would in a step's 4 ms of model time.
            await asyncio.sleep(0.002)
        usage = Usage(64, steps + 1, 0, 0, 0)
        last = [(request_id, RequestOutput([40], "", FinishReason.LENGTH, usage=usage))
                for request_id in ids]
        body = pickle.dumps(("step", compact_outputs(last), status), pickle.HIGHEST_PROTOCOL)
        start = time.process_time()
        message = pickle.loads(body)
        engine.on_step(message[1], message[2])
        while any(not request.outputs.empty() or not request.outputs._getters for request in
                  requests if request.request_id in engine.requests) or engine.requests:
            await asyncio.sleep(0)
        while clients.poll() is None:  # the responses end: the clients see every stream close
            await asyncio.sleep(0.001)
        finish_cpu = time.process_time() - start
        return cpu_per_step, admit_cpu, finish_cpu
    finally:
        clients.kill()
        clients.wait()
        await server.stop(grace_s=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--direct", default="off,on", help="direct SSE writes: off, on or both")
    parser.add_argument("--rounds", type=int, default=1,
                        help="servers started in turn; past one, the first is not counted")
    parser.add_argument("--read", nargs=3, type=int, help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.read:
        read_clients(*args.read)
        return
    for mode in args.direct.split(","):
        rounds = [asyncio.run(run(args.streams, args.steps, mode == "on"))
                  for _ in range(args.rounds)]
        timed = rounds[1:] or rounds  # past the first round's warm-up (imports, first requests)
        cpu = [step for steps, _, _ in timed for step in steps[args.steps // 10:]]
        admit = statistics.fmean(admit for _, admit, _ in timed)
        finish = statistics.fmean(finish for _, _, finish in timed)
        median_ms = statistics.median(cpu) * 1000
        print(json.dumps({
            "sse_direct_writes": mode,
            "streams": args.streams,
            "steps": len(cpu),
            "rounds_timed": len(timed),
            "cpu_ms_per_step_median": round(median_ms, 3),
            "cpu_ms_per_step_mean": round(statistics.fmean(cpu) * 1000, 3),
            "cpu_us_per_output": round(median_ms * 1000 / args.streams, 2),
            "cpu_us_to_admit_a_stream": round(admit * 1e6 / args.streams, 1),
            "cpu_us_to_end_a_stream": round(finish * 1e6 / args.streams, 1),
        }))


if __name__ == "__main__":
    main()
