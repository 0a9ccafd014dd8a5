"""The engine core's own work per decode step behind frontend processes, in one process: no
gRPC, no model service, no clients, so what is left is the core's Python and C, without the
other processes' noise on a shared machine.

N running sequences (64-token prompts, greedy, no stop strings, text made by the frontends) are
split over two frontends' hubs. Each step is what the engine loop does with overlap on: schedule
and commit the next plan, reconcile the oldest result (one token a sequence), deliver the
outputs (metrics counted, each into its frontend's batch), and flush each frontend's step
message (pickled as the link pickles it). Prints the median and mean process CPU a step.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_core_step.py [--streams 256] [--steps 400] \\
        [--interval 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos"), os.path.join(ROOT, "tests", "scheduler")]

from factories import make_request, make_scheduler  # noqa: E402

from scheduler_service.core.plan import StepResult  # noqa: E402
from scheduler_service.engine.loop import EngineLoop  # noqa: E402
from scheduler_service.frontends.hub import _Peer  # noqa: E402
from scheduler_service.metrics import Metrics  # noqa: E402

NUM_FRONTENDS = 2


def _result(plan) -> StepResult:
    """One token for every entry (each sequence's prompt was computed in the first step)."""
    n = len(plan.requests)
    return StepResult(step_id=plan.step_id, num_sampled_tokens=[1] * n,
                      sampled_token_ids=[7 + i % 50 for i in range(n)],
                      forward_ns=0, sample_ns=0, total_ns=0)


def run(streams: int, steps: int, interval: int) -> list[float]:
    scheduler = make_scheduler(num_blocks=streams * 40 + 8, block_size=16,
                               max_num_batched_tokens=max(8192, 64 * streams), max_num_seqs=streams,
                               max_num_slots=streams, max_model_len=4096)
    hub = types.SimpleNamespace(flush_soon=lambda: None)
    link = types.SimpleNamespace(send=lambda message: pickle.dumps(message, protocol=5))
    peers = [_Peer(hub, i, link, types.SimpleNamespace(pid=0)) for i in range(NUM_FRONTENDS)]
    for i in range(streams):
        request = make_request(64, 1 << 30, ignore_eos=True, request_id=f"r{i}",
                               stream_interval=interval)
        # As the frontend's link delivers it (frontends/link.py pickles it).
        request = pickle.loads(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        request.detokenize = False
        peers[i % NUM_FRONTENDS].track(request)
        scheduler.add_request(request)
    loop = types.SimpleNamespace(metrics=Metrics())
    in_flight: collections.deque = collections.deque()
    times = []
    for _ in range(steps):
        start = time.process_time()
        if len(in_flight) < 2:
            plan = scheduler.schedule()
            scheduler.commit(plan)
            in_flight.append(plan)
        if len(in_flight) == 2:
            plan = in_flight.popleft()
            EngineLoop._deliver(loop, scheduler.reconcile(plan, _result(plan)))
            for peer in peers:
                peer.flush(None)
        times.append(time.process_time() - start)
    return times[10:]  # the prefill and the first plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--interval", type=int, default=1)
    args = parser.parse_args()
    times = run(args.streams, args.steps, args.interval)
    print(json.dumps({
        "streams": args.streams, "stream_interval": args.interval,
        "core_ms_per_step_median": round(1000 * statistics.median(times), 3),
        "core_ms_per_step_mean": round(1000 * statistics.mean(times), 3),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
