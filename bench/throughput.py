"""Output tokens/s of a running planserve for 1 and for N concurrent requests.

    .venv/bin/planserve serve &            # or: planserve serve --model tiny --port 0
    .venv/bin/python bench/throughput.py --port 50051 --concurrency 1 16 --new-tokens 128

Each request is a different chat prompt, greedy, EOS ignored so that every request produces
exactly --new-tokens tokens. Prints one JSON line per concurrency level.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import grpc

from planserve.v1 import generate_pb2_grpc
from scheduler_service.api.client import build_request

TOPICS = ["the sea", "mountains", "a city at night", "autumn", "a library", "trains",
          "the moon", "a garden", "rain", "bread", "rivers", "a lighthouse", "snow",
          "coffee", "bridges", "stars"]


async def _one(stub, index: int, new_tokens: int) -> tuple[float, float, int]:
    request = build_request(f"Write a long story about {TOPICS[index % len(TOPICS)]}.",
                            chat=True, temperature=0.0, max_new_tokens=new_tokens,
                            ignore_eos=True)
    start = time.perf_counter()
    first = None
    count = 0
    async for chunk in stub.Generate(request):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
        count += len(chunk.token_ids)
    return first, time.perf_counter() - start, count


async def run(address: str, concurrency: int, new_tokens: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        await _one(stub, 0, 4)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(stub, i, new_tokens) for i in range(concurrency)))
        elapsed = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    return {
        "concurrency": concurrency,
        "new_tokens_each": new_tokens,
        "output_tokens": tokens,
        "seconds": round(elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "ttft_p50_ms": round(statistics.median(r[0] for r in results) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    for concurrency in args.concurrency:
        print(json.dumps(asyncio.run(run(f"{args.host}:{args.port}", concurrency,
                                         args.new_tokens))), flush=True)


if __name__ == "__main__":
    main()
