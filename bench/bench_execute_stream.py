"""The model service's host CPU per step, alone: `python -m model_service --model null
--null-step-delay-ms D` fed one Execute stream of scripted plans, the way the scheduler feeds it
(two plans in flight), with no scheduler process, no clients and no arrival spread:

  one prefill step registers N sequences of P prompt tokens, then T decode steps of all N
  (each sequence one token a step, a new block every block_size tokens).

Per decode step: the model service process's CPU time (user + system, all threads, from /proc)
and, with --threads, each thread's. bench_host_path.py measures the same process behind
`planserve serve`, where its steps carry however many streams the scheduler admitted; here every
step carries N sequences, so the figure is the model service's own cost of an N-sequence step.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_execute_stream.py \\
        [--seqs 256] [--steps 512] [--delay-ms 4] [--runs 3] [--threads] [--code ROOT]
        [--engine-flags "--cuda-graphs eager --launch-ahead on"]

--code ROOT runs the model service from another checkout (its model_service and protos), to
compare two trees with the same driver.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos")]

import grpc  # noqa: E402

from planserve.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROMPT_LEN = 64
BLOCK_SIZE = 16


def _ticks(path: str) -> tuple[str, int]:
    with open(path) as f:
        text = f.read()
    fields = text.rsplit(")", 1)[1].split()
    return text[text.index("(") + 1 : text.rindex(")")], int(fields[11]) + int(fields[12])


def thread_ticks(pid: int) -> dict[str, tuple[str, int]]:
    """Thread id -> (name, user + system ticks)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found[tid] = _ticks(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return found


class Plans:
    """The scripted plans: a prefill of every sequence, then decodes of all of them."""

    def __init__(self, num_seqs: int) -> None:
        self.num_seqs = num_seqs
        self.step_id = 0
        self.length = PROMPT_LEN  # tokens each sequence will have computed after the next step
        self.next_block = 1

    def _blocks(self, num_blocks: int, plan: engine_pb2.BatchPlan) -> None:
        plan.num_new_blocks.extend([num_blocks] * self.num_seqs)
        count = num_blocks * self.num_seqs
        plan.new_block_ids.extend(range(self.next_block, self.next_block + count))
        self.next_block += count

    def prefill(self) -> engine_pb2.ExecuteRequest:
        request = engine_pb2.ExecuteRequest()
        plan = request.plan
        plan.step_id = self.step_id = self.step_id + 1
        for slot in range(self.num_seqs):
            prompt = [32 + (slot * 7 + j) % 90 for j in range(PROMPT_LEN)]
            sequence = plan.new_sequences.add(slot=slot, token_ids=prompt, num_computed_tokens=0)
            sequence.sampling.temperature = 0.0
            sequence.sampling.seed = slot
        plan.slots.extend(range(self.num_seqs))
        plan.num_scheduled_tokens.extend([PROMPT_LEN] * self.num_seqs)
        self._blocks(-(-PROMPT_LEN // BLOCK_SIZE), plan)
        return request

    def decode(self) -> engine_pb2.ExecuteRequest:
        request = engine_pb2.ExecuteRequest()
        plan = request.plan
        plan.step_id = self.step_id = self.step_id + 1
        plan.slots.extend(range(self.num_seqs))
        plan.num_scheduled_tokens.extend([1] * self.num_seqs)
        # This step writes position `length`: a new block when it starts one.
        self._blocks(1 if self.length % BLOCK_SIZE == 0 else 0, plan)
        self.length += 1
        return request


def run_stream(port: int, num_seqs: int, num_steps: int, on_start, on_end) -> float:
    """Prefill, then num_steps decodes with two plans in flight; returns the decodes' wall s.
    on_start runs once the prefill's result is in, on_end once the last decode's is (while the
    stream and its threads are still open)."""
    plans = Plans(num_seqs)
    credits: queue.SimpleQueue = queue.SimpleQueue()

    def requests():
        yield plans.prefill()
        credits.get()  # the prefill's result: the decodes start from here
        on_start()
        for _ in range(num_steps):
            credits.get()
            yield plans.decode()

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        credits.put(1)
        credits.put(1)
        started, received = 0.0, 0
        for response in stub.Execute(requests()):
            assert len(response.result.sampled_token_ids) == num_seqs
            received += 1
            if received == 1:
                started = time.perf_counter()
            elif received == num_steps + 1:
                on_end()
                return time.perf_counter() - started
            credits.put(1)
    raise RuntimeError(f"the stream ended after {received} results")


def start_model_service(args) -> tuple[subprocess.Popen, int]:
    code = os.path.abspath(args.code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(code, "protos"), code]))
    command = [
        sys.executable, "-m", "model_service", "--model", "null", "--port", "0",
        "--null-step-delay-ms", str(args.delay_ms), "--max-num-slots", str(args.seqs),
        *args.engine_flags.split(),
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=code
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("PLANSERVE_ENGINE_PORT="):
            return process, int(line.split("=", 1)[1])
    raise RuntimeError(f"the model service exited with {process.wait()}")


def measure(process: subprocess.Popen, port: int, args) -> dict:
    marks: dict = {}

    def mark(when: str) -> None:
        marks[when] = thread_ticks(process.pid), _ticks(f"/proc/{process.pid}/stat")[1]

    wall = run_stream(port, args.seqs, args.steps, lambda: mark("start"), lambda: mark("end"))
    (before, cpu0), (after, cpu1) = marks["start"], marks["end"]
    cpu_ms = (cpu1 - cpu0) * 1000 / CLOCK_TICKS
    row = {
        "seqs": args.seqs,
        "steps": args.steps,
        "delay_ms": args.delay_ms,
        "engine_flags": args.engine_flags,
        "cpu_ms_per_step": round(cpu_ms / args.steps, 3),
        "step_ms": round(wall * 1000 / args.steps, 3),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    if args.threads:
        per_thread = {}
        for tid, (name, ticks) in after.items():
            spent = ticks - before.get(tid, (name, 0))[1]
            if spent:
                key = f"{name}/{'main' if tid == str(process.pid) else tid}"
                per_thread[key] = round(spent * 1000 / CLOCK_TICKS / args.steps, 3)
        row["threads_cpu_ms_per_step"] = per_thread
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--delay-ms", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3, help="streams one after another")
    parser.add_argument("--threads", action="store_true", help="CPU of each thread too")
    parser.add_argument("--code", default=ROOT, help="the checkout the model service runs from")
    parser.add_argument("--label", default="")
    parser.add_argument(
        "--engine-flags",
        default="",
        help='more model service flags, e.g. "--cuda-graphs eager --launch-ahead on": the padded '
        "steps and launch-ahead, CUDA's host path, on the CPU",
    )
    default_out = os.path.join(ROOT, "bench", "results", "execute_stream.json")
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()
    process, port = start_model_service(args)
    rows = []
    try:
        for _ in range(args.runs):
            rows.append(measure(process, port, args))
            print(json.dumps({"label": args.label, "code": args.code, **rows[-1]}), flush=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
    if not args.no_write:
        append_run(args, rows, load_before)


def append_run(args, rows: list[dict], load_before) -> None:
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    results.setdefault("runs", []).append({
        "label": args.label,
        "code": args.code,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_before": [round(x, 2) for x in load_before]},
        "rows": rows,
    })  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
