"""Orchestration alone, on the null model (`--model null`: no compute), at 1, 64 and 256 running
decode sequences, each part on its own:

  schedule + encode   Scheduler.schedule() + plan.to_pb() + SerializeToString (scheduler process)
  round trip          write the ExecuteRequest on the Execute stream, read the ExecuteResponse,
                      against a real null model service process; `engine_ms` is the service's own
                      total_ns (plan decode, checks, input build, null forward, sample, encode),
                      the rest is gRPC and the two event loops
  decode + update     plan.result_from_pb() + Scheduler.update() (stops, detokenize, outputs)
  plan bytes          ExecuteRequest bytes per running decode sequence per decode step

and then the whole system (`planserve serve --model null`, two processes, the clients in this
one) at the same number of concurrent streams with stream_interval 1 and 8, from the client side:
per-step wall time (TPOT), tokens/s, chunks received, and the CPU time each process spent per
step. Fan-out (outputs to client streams) is not timed on its own inside the server; it is given
as the whole-system step time minus the three parts above ("fanout_by_subtraction_ms").

    PYTHONPATH=protos:. .venv/bin/python bench/bench_orchestration.py [--steps 200]

Writes bench/results/orchestration.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos"), os.path.join(ROOT, "tests", "scheduler")]

import grpc  # noqa: E402
from factories import make_request  # noqa: E402

from planserve.v1 import engine_pb2, engine_pb2_grpc, generate_pb2, generate_pb2_grpc  # noqa: E402
from scheduler_service.config import SchedulerConfig  # noqa: E402
from scheduler_service.engine.client import EngineFacts  # noqa: E402
from scheduler_service.text.outputs import OutputProcessor  # noqa: E402
from scheduler_service.core.plan import result_from_pb, to_pb  # noqa: E402
from scheduler_service.core.scheduler import Scheduler  # noqa: E402
from scheduler_service.text.tokenizer import Tokenizer  # noqa: E402

SIZES = (1, 64, 256)
PROMPT_LEN = 128
PORT_LINE = "PLANSERVE_ENGINE_PORT="
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch_cpu" in f.read()


def _ms(samples_ns: list[int]) -> dict:
    return {"median": round(statistics.median(samples_ns) / 1e6, 4), "best": round(min(samples_ns) / 1e6, 4),
            "p90": round(sorted(samples_ns)[int(0.9 * (len(samples_ns) - 1))] / 1e6, 4)}


def start_engine(*args: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "model_service", "--port", "0", "--model", "null", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT])))
    for line in process.stdout:
        if line.startswith(PORT_LINE):
            return process, f"127.0.0.1:{int(line[len(PORT_LINE):])}"
    raise RuntimeError(f"model service exited with {process.wait()}")


async def measure_parts(address: str, num_running: int, steps: int, warmup: int) -> dict:
    channel = grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    facts = EngineFacts.from_pb(await stub.Describe(engine_pb2.DescribeRequest(), timeout=60))
    tokenizer = Tokenizer(facts.tokenizer_json, facts.chat_template, facts.special_tokens)
    config = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=8192, max_queue_len=num_running).validate()
    scheduler = Scheduler(config, facts, OutputProcessor(tokenizer, facts.eos_token_ids, facts.max_model_len))
    for i in range(num_running):
        scheduler.add_request(make_request(
            prompt_token_ids=[32 + (i + j) % 200 for j in range(PROMPT_LEN)], max_new_tokens=warmup + steps + 64,
            ignore_eos=True, request_id=f"r{i}", arrival_time=float(i)))
    call = stub.Execute()

    async def step():
        t0 = time.perf_counter_ns()
        plan = scheduler.schedule()
        request = to_pb(plan)
        wire = request.SerializeToString()
        t1 = time.perf_counter_ns()
        await call.write(request)
        response = await call.read()
        t2 = time.perf_counter_ns()
        result = result_from_pb(response)
        scheduler.update(plan, result)
        t3 = time.perf_counter_ns()
        return plan, len(wire), t1 - t0, t2 - t1, t3 - t2, response.result.total_ns

    # Prefill everyone (untimed), then time pure decode steps.
    while len(scheduler.running) < num_running or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
        await step()
    plan_ns, rt_ns, update_ns, engine_ns, wire_bytes = [], [], [], [], []
    for i in range(warmup + steps):
        plan, nbytes, a, b, c, engine = await step()
        assert len(plan.slots) == num_running and not plan.new_sequences, "not a pure decode step"
        if i >= warmup:
            plan_ns.append(a)
            rt_ns.append(b)
            update_ns.append(c)
            engine_ns.append(engine)
            wire_bytes.append(nbytes)
    call.cancel()
    await channel.close()
    return {
        "running_decodes": num_running,
        "schedule_encode_ms": _ms(plan_ns),
        "round_trip_ms": _ms(rt_ns),
        "engine_ms": _ms(engine_ns),
        "decode_update_ms": _ms(update_ns),
        "plan_bytes": statistics.median(wire_bytes),
        "plan_bytes_per_decode_seq": round(statistics.median(wire_bytes) / num_running, 2),
        "steps": steps,
    }


def _engine_child(pid: int) -> int:
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children = f.read().split()
        if children:
            return int(children[0])
    raise RuntimeError("planserve serve has no model service child")


async def measure_system(num_streams: int, stream_interval: int, new_tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT]))
    server = subprocess.Popen(
        [sys.executable, "-m", "tools", "serve", "--model", "null", "--port", "0", "--engine-port", "0",
         "--http-port", "-1", "--metrics-port", "-1", "--max-num-seqs", str(max(num_streams, 1)),
         "--max-num-batched-tokens", "8192"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    # Read stdout to the end in the background: a full pipe would block the server.
    try:
        for line in server.stdout:
            if line.startswith("PLANSERVE_PORT="):
                port = int(line.split("=", 1)[1])
                break
        else:
            raise RuntimeError("planserve serve exited")
        threading.Thread(target=server.stdout.read, daemon=True).start()
        engine_pid = _engine_child(server.pid)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)

            async def one(i: int, tokens: int):
                request = generate_pb2.GenerateRequest(request_id=f"s{i}-{tokens}")
                request.token_ids.ids.extend([32 + (i + j) % 200 for j in range(PROMPT_LEN)])
                request.sampling.temperature = 0.0
                request.stopping.max_new_tokens = tokens
                request.stopping.ignore_eos = True
                if stream_interval != 1:
                    request.stream_interval = stream_interval
                times, counts = [], []
                async for chunk in stub.Generate(request):
                    if chunk.token_ids:
                        times.append(time.perf_counter())
                        counts.append(len(chunk.token_ids))
                return times, counts

            await asyncio.gather(*(one(i, 4) for i in range(num_streams)))  # warm-up
            cpu0 = (_cpu_s(server.pid), _cpu_s(engine_pid), time.process_time())
            start = time.perf_counter()
            runs = await asyncio.gather(*(one(i, new_tokens) for i in range(num_streams)))
            wall = time.perf_counter() - start
            cpu1 = (_cpu_s(server.pid), _cpu_s(engine_pid), time.process_time())
        # Decode steps ~ new_tokens (the first token comes from the prefill step).
        steps = new_tokens
        tpot = statistics.median((t[-1] - t[0]) / (sum(c) - c[0]) for t, c in runs if sum(c) > c[0])
        return {
            "streams": num_streams,
            "stream_interval": stream_interval,
            "new_tokens_each": new_tokens,
            "output_tokens_per_s": round(num_streams * new_tokens / wall, 1),
            "step_ms_tpot_median": round(tpot * 1000, 4),
            "chunks_per_stream": statistics.median(len(c) for _, c in runs),
            "cpu_ms_per_step": {
                "scheduler_process": round((cpu1[0] - cpu0[0]) * 1000 / steps, 3),
                "model_service_process": round((cpu1[1] - cpu0[1]) * 1000 / steps, 3),
                "client_process": round((cpu1[2] - cpu0[2]) * 1000 / steps, 3),
            },
            "threads": {"scheduler_process": _threads(server.pid), "model_service_process": _threads(engine_pid)},
            "torch_loaded": {"scheduler_process": _maps_torch(server.pid), "model_service_process": _maps_torch(engine_pid)},
        }
    finally:
        server.terminate()
        server.wait(timeout=20)


def torch_threads_of_model_service() -> int:
    """torch.get_num_threads() as the model service starts it (no override: torch's default)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads(), torch.get_num_interop_threads())"],
                         capture_output=True, text=True, check=True).stdout.split()
    return {"intra_op": int(out[0]), "inter_op": int(out[1])}


async def main_async(args) -> dict:
    engine, address = start_engine()
    try:
        parts = [await measure_parts(address, n, args.steps, args.warmup) for n in SIZES]
    finally:
        engine.terminate()
        engine.wait(timeout=20)
    system = []
    for n in SIZES:
        for interval in (1, 8):
            system.append(await measure_system(n, interval, args.new_tokens))
    for row in system:
        part = next(p for p in parts if p["running_decodes"] == row["streams"])
        inside = part["schedule_encode_ms"]["median"] + part["round_trip_ms"]["median"] + part["decode_update_ms"]["median"]
        row["fanout_by_subtraction_ms"] = round(row["step_ms_tpot_median"] - inside, 4)
    return {"parts": parts, "system": system}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "orchestration.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = asyncio.run(main_async(args))
    results["goals"] = {
        "schedule_encode_under_300us_at_256": next(p for p in results["parts"] if p["running_decodes"] == 256)["schedule_encode_ms"]["median"] < 0.3,
        "plan_bytes_per_decode_seq_at_most_12": all(p["plan_bytes_per_decode_seq"] <= 12 for p in results["parts"] if p["running_decodes"] >= 64),
    }
    results["threads"] = {
        "model_service_torch": torch_threads_of_model_service(),
        "scheduler_torch": "none (the scheduler process never imports torch; see system[].torch_loaded)",
    }
    results["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
                          "loadavg_before": [round(x, 2) for x in load_before],
                          "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    for p in results["parts"]:
        print(f"N={p['running_decodes']:4d}  schedule+encode {p['schedule_encode_ms']['median']:.3f} ms  "
              f"round trip {p['round_trip_ms']['median']:.3f} ms (engine {p['engine_ms']['median']:.3f})  "
              f"decode+update {p['decode_update_ms']['median']:.3f} ms  plan {p['plan_bytes_per_decode_seq']} B/seq")
    for s in results["system"]:
        print(f"N={s['streams']:4d} interval={s['stream_interval']}  step {s['step_ms_tpot_median']:.3f} ms  "
              f"{s['output_tokens_per_s']} tok/s  chunks/stream {s['chunks_per_stream']}  "
              f"fan-out (by subtraction) {s['fanout_by_subtraction_ms']:.3f} ms  cpu/step {s['cpu_ms_per_step']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
