"""Output tokens/s with and without speculative decoding on a repetitive workload.

    .venv/bin/python bench/bench_speculative.py --out bench/results/speculative.json

For each configuration (no speculation, n-gram lookup with k = 2 and 4) this starts a model
service (SmolLM2, default dtype) and a scheduler on 127.0.0.1, sends the same requests (asking
the model to repeat, quote and summarise a given text: the outputs reuse the prompt's phrases,
where prompt lookup pays), greedy with EOS ignored, at concurrency 1 and 4, and reports output
tokens/s, the draft acceptance rate, and whether the tokens equal the unspeculated run's.
The two processes share the machine's cores; nothing else should run meanwhile.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import grpc

from planserve.v1 import generate_pb2_grpc
from scheduler_service.api.client import build_request
from scheduler_service.config import SchedulerConfig
from scheduler_service.server import SchedulerServer

TEXT = (
    "The printing press, invented by Johannes Gutenberg around 1440, changed how knowledge spread "
    "across Europe. Before it, books were copied by hand, which made them rare and expensive. With "
    "movable type, printers could produce hundreds of copies quickly, and literacy rose as books "
    "became cheaper. Scientists shared results faster, religious debates reached wider audiences, "
    "and standard spellings emerged."
)
TASKS = [
    "Repeat the following text word for word, then repeat it once more:\n\n",
    "Quote the following text exactly, sentence by sentence, each on its own line:\n\n",
    "Copy this text, then list every sentence of it as a bullet point:\n\n",
    "Rewrite the following text, keeping as many of its words as you can:\n\n",
]
CONFIGS = {"none": [], "ngram-k2": ["--speculative-method", "ngram", "--num-speculative-tokens", "2"],
           "ngram-k4": ["--speculative-method", "ngram", "--num-speculative-tokens", "4"]}


def _start_engine(extra: list[str]) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "model_service", "--port", "0", *extra],
                               stdout=subprocess.PIPE, text=True, env=dict(os.environ, PLANSERVE_LOG_JSON="1"),
                               stderr=subprocess.DEVNULL)
    for line in process.stdout:
        if line.startswith("PLANSERVE_ENGINE_PORT="):
            return process, f"127.0.0.1:{int(line.split('=')[1])}"
    raise RuntimeError("model service did not start")


async def _one(stub, index: int, new_tokens: int) -> list[int]:
    request = build_request(TASKS[index % len(TASKS)] + TEXT, chat=True, temperature=0.0,
                            max_new_tokens=new_tokens, ignore_eos=True)
    tokens = []
    async for chunk in stub.Generate(request):
        tokens.extend(chunk.token_ids)
    return tokens


async def _measure(name: str, extra: list[str], concurrency: list[int], new_tokens: int) -> dict:
    process, address = _start_engine(extra)
    server = SchedulerServer(SchedulerConfig(port=0, engine_address=address))
    try:
        await server.start()
        await server.connect_engine()
        scheduler = server.loop.scheduler
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)
            await _one(stub, 0, 4)  # warm-up
            rows = []
            for c in concurrency:
                drafts0, accepted0 = scheduler.num_draft_tokens_total, scheduler.num_accepted_draft_tokens_total
                start = time.perf_counter()
                outputs = await asyncio.gather(*(_one(stub, i, new_tokens) for i in range(c)))
                seconds = time.perf_counter() - start
                drafts = scheduler.num_draft_tokens_total - drafts0
                accepted = scheduler.num_accepted_draft_tokens_total - accepted0
                rows.append({
                    "concurrency": c, "output_tokens": sum(map(len, outputs)), "seconds": round(seconds, 2),
                    "output_tokens_per_s": round(sum(map(len, outputs)) / seconds, 1),
                    "draft_tokens": drafts, "accepted_tokens": accepted,
                    "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
                    "outputs": outputs,
                })
        return {"config": name, "flags": extra, "runs": rows}
    finally:
        await server.stop(grace_s=1)
        process.terminate()
        process.wait(timeout=30)


async def main_async(args) -> dict:
    dtype = ["--dtype", args.dtype]
    results = [await _measure(name, CONFIGS[name] + dtype, args.concurrency, args.new_tokens) for name in args.configs]
    baseline = {r["concurrency"]: r["outputs"] for r in results[0]["runs"]}
    for result in results:
        for run in result["runs"]:
            run["tokens_equal_to_" + results[0]["config"]] = run.pop("outputs") == baseline[run["concurrency"]]
    return {"model": "smollm2", "dtype": args.dtype, "new_tokens": args.new_tokens, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
