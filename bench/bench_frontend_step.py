"""A frontend process's own work per decode step, in one process: no gRPC transport, no engine
core, no clients, so what is left is planserve's Python between the link and the gRPC library.

N Generate streams (64-token prompts, greedy, no stop strings: the frontend makes their text)
are admitted through the real GenerationServicer over a RemoteEngine. Each step is what a
frontend does with one step message from the core: unpickle it, hand every stream its output
(RemoteEngine.on_step: detokenize, queue), and let every stream's Generate coroutine turn its
output into the chunk it yields (each chunk serialized, as grpc does, and a loop pass in place of
grpc's send). Prints the median and mean process CPU a step and per output.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_frontend_step.py [--streams 128] \\
        [--steps 400]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pickle
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos"), os.path.join(ROOT, "tests", "scheduler")]

from factories import make_facts  # noqa: E402

from bench.bench_host_path import generate_request  # noqa: E402
from cython_ext.step_outputs import compact_outputs  # noqa: E402
from model_service.models.null import NULL_VOCAB_SIZE, null_tokenizer_json  # noqa: E402
from scheduler_service.api.admission import Admission, Serving  # noqa: E402
from scheduler_service.api.grpc_servicer import GenerationServicer  # noqa: E402
from scheduler_service.config import SchedulerConfig  # noqa: E402
from scheduler_service.core.request import RequestOutput  # noqa: E402
from scheduler_service.frontends.remote import RemoteEngine, Status  # noqa: E402
from scheduler_service.text.tokenizer import Tokenizer  # noqa: E402


class _Link:
    """The frontend's end of the link, kept: the adds it sends say which ids the core knows;
    a barrier call (an HTTP door's add) is answered as the core would."""

    def __init__(self):
        self.added: list[str] = []
        self.engine: RemoteEngine | None = None

    def send(self, message: tuple) -> None:
        if message[0] == "add":
            self.added.append(message[1].request_id)
        elif message[0] == "call" and message[2] == "barrier" and self.engine is not None:
            # An HTTP door waits for the core to take its add: the core answers in order.
            asyncio.get_running_loop().call_soon(self.engine.on_reply, message[1], None)


def frontend(max_model_len: int) -> tuple[_Link, Status, RemoteEngine, Admission]:
    """A frontend's RemoteEngine and admission over the null model's tokenizer, its link kept."""
    tokenizer = Tokenizer(null_tokenizer_json(), "", {})
    facts = dataclasses.replace(make_facts(max_model_len=max_model_len),
                                tokenizer_json=null_tokenizer_json(), vocab_size=NULL_VOCAB_SIZE)
    link = _Link()
    status = Status(engine_up=True, capacity_tokens=1 << 20, num_usable_blocks=1 << 16,
                    num_free_blocks=1 << 16)
    engine = RemoteEngine(link, status, tokenizer)  # type: ignore[arg-type]
    link.engine = engine
    admission = Admission(SchedulerConfig())
    admission.serving = Serving.of(facts, tokenizer, engine, SchedulerConfig().grammar_engine)
    return link, status, engine, admission


async def run(streams: int, steps: int) -> list[float]:
    link, status, engine, admission = frontend(max_model_len=64 + steps + 64)
    servicer = GenerationServicer(admission)
    num_chunks = [0]

    async def stream(i: int) -> None:
        request = generate_request(i, steps + 8, 1, "bench")
        async for chunk in servicer.Generate(request, None):  # type: ignore[arg-type]
            chunk.SerializeToString()
            num_chunks[0] += 1
            await asyncio.sleep(0)  # grpc's send: the stream waits a loop pass

    tasks = [asyncio.ensure_future(stream(i)) for i in range(streams)]
    while len(link.added) < streams:
        for task in tasks:
            if task.done():
                task.result()  # a stream refused: its error, not a wait for ever
        await asyncio.sleep(0)
    ids = list(link.added)
    cpu_per_step = []
    for step in range(steps):
        batch = [(request_id, RequestOutput([40 + (step + n) % 50], "")) for n, request_id in
                 enumerate(ids)]
        body = pickle.dumps(("step", compact_outputs(batch), status), pickle.HIGHEST_PROTOCOL)
        wanted = num_chunks[0] + streams
        start = time.process_time()
        message = pickle.loads(body)
        engine.on_step(message[1], message[2])
        while num_chunks[0] < wanted:
            await asyncio.sleep(0)
        cpu_per_step.append(time.process_time() - start)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return cpu_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    cpu = asyncio.run(run(args.streams, args.steps))[args.steps // 10:]  # past the warm-up
    median_ms = statistics.median(cpu) * 1000
    print(json.dumps({
        "streams": args.streams,
        "steps": len(cpu),
        "cpu_ms_per_step_median": round(median_ms, 3),
        "cpu_ms_per_step_mean": round(statistics.fmean(cpu) * 1000, 3),
        "cpu_us_per_output": round(median_ms * 1000 / args.streams, 2),
    }))


if __name__ == "__main__":
    main()
