"""What one agent costs the other clients: 15 plain streaming chat requests (greedy, ignore_eos,
sent at once) alone, beside one client sending named-tool requests one after another (each
generated under its tool's grammar), beside one sending json_schema requests, and beside one
sending plain requests (the control: a 16th stream without a grammar). Reports the 15 streams'
output tokens/s per case (each run sends the 15 `--waves` times in a row).

Several source trees can be compared in one run (`--tree NAME=PATH`, e.g. the commit before a
change checked out elsewhere): a server is started from each tree, and every repetition runs
every tree's cases back to back, the trees' order alternating (A B, then B A), so that a busy
machine's drift falls on both alike. The slowdown of a case is taken per repetition
against the same tree's "alone" run of that repetition, and its median reported.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_tool_overlap.py --model tiny \\
        [--tree before=/tmp/planserve-before] [--reps 6] [--grammar-engine llguidance] \\
        --out bench/results/tool_overlap_cpu.json
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
import time

import openai

HTTP_LINE = "PLANSERVE_HTTP_PORT="
PLAIN = 15
TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "enum": ["CET", "UTC", "PST"]},
                "hours": {"type": "integer", "enum": [1, 2, 24]},
            },
            "required": ["zone", "hours"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "array", "items": {"type": "integer", "enum": [1, 2, 3]}, "maxItems": 4},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CASES = ("alone", "beside tool", "beside json_schema", "beside plain")


def _serve(tree: str, model: str, extra: list[str]) -> tuple[subprocess.Popen, int]:
    tree = os.path.abspath(tree)
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONPATH=f"{tree}:{tree}/protos",
    )
    command = [sys.executable, "-m", "tools", "serve", "--model", model, "--port", "0"]
    command += ["--engine-port", "0", "--http-port", "0", "--metrics-port", "-1", *extra]
    process = subprocess.Popen(
        command, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(HTTP_LINE):
            return process, int(line[len(HTTP_LINE) :])
    raise RuntimeError(f"planserve serve did not start from {tree}")


async def _plain_stream(client, model: str, index: int, new_tokens: int) -> int:
    stream = await client.chat.completions.create(
        model=model,
        max_tokens=new_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": f"Tell me a story about number {index}."}],
    )
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


def _beside_sends(client, model: str) -> dict:
    """One request of each beside-client kind (what the 16th client sends, again and again)."""
    messages = [{"role": "user", "content": "Time?"}]

    async def tool() -> None:
        named = {"type": "function", "function": {"name": "get_time"}}
        await client.chat.completions.create(
            model=model, max_tokens=40, messages=messages, tools=[TOOL], tool_choice=named
        )

    async def json_schema() -> None:
        schema = {"name": "trip", "schema": SCHEMA}
        await client.chat.completions.create(
            model=model,
            max_tokens=40,
            messages=messages,
            response_format={"type": "json_schema", "json_schema": schema},
        )

    async def plain() -> None:
        await client.chat.completions.create(
            model=model, max_tokens=40, messages=messages, extra_body={"ignore_eos": True}
        )

    return {"beside tool": tool, "beside json_schema": json_schema, "beside plain": plain}


async def _beside(send, stop: asyncio.Event) -> int:
    """Requests one after another until `stop`; how many were made."""
    calls = 0
    while not stop.is_set():
        await send()
        calls += 1
    return calls


async def _case(port: int, case: str, new_tokens: int, waves: int) -> dict:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600
    )
    model = (await client.models.list()).data[0].id
    send = _beside_sends(client, model).get(case)
    stop = asyncio.Event()
    agent = asyncio.ensure_future(_beside(send, stop)) if send is not None else None
    start = time.perf_counter()
    tokens = 0
    for _ in range(waves):  # longer runs: this machine's noise is seconds long
        streams = (_plain_stream(client, model, i, new_tokens) for i in range(PLAIN))
        tokens += sum(await asyncio.gather(*streams))
    seconds = time.perf_counter() - start
    stop.set()
    calls = await agent if agent is not None else 0
    await client.close()
    # The beside client's own pace too: a constrained request decodes every other step now.
    beside_s = time.perf_counter() - start
    return {
        "tok_s": round(tokens / seconds, 1),
        "seconds": round(seconds, 2),
        "beside": calls,
        "beside_per_s": round(calls / beside_s, 2),
    }


async def _warm(port: int, new_tokens: int) -> None:
    """Every beside kind once (grammars compiled and cached) and one plain stream."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    model = (await client.models.list()).data[0].id
    for send in _beside_sends(client, model).values():
        await send()
    await _plain_stream(client, model, -1, new_tokens)
    await client.close()


def _summary(runs: dict) -> dict:
    """Per tree and case: every run's tok/s, the median, and the median per-repetition slowdown
    against the same tree's "alone" run."""
    summary: dict = {}
    for tree, cases in runs.items():
        alone = [r["tok_s"] for r in cases["alone"]]
        summary[tree] = {}
        for case, results in cases.items():
            values = [r["tok_s"] for r in results]
            entry = {"tok_s": values, "median_tok_s": statistics.median(values)}
            if case != "alone":
                paces = [r["beside_per_s"] for r in results]
                entry["median_beside_requests_per_s"] = statistics.median(paces)
                cuts = [1 - v / a for v, a in zip(values, alone)]
                entry["slowdown_per_rep"] = [round(c, 3) for c in cuts]
                entry["median_slowdown"] = round(statistics.median(cuts), 3)
            summary[tree][case] = entry
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument(
        "--grammar-engine", default="llguidance", choices=("llguidance", "outlines")
    )
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH (repeatable)")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=448)  # the tiny model holds 512
    parser.add_argument("--waves", type=int, default=2, help="the 15 streams, again, per run")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": "."}
    servers = {
        name: _serve(path, args.model, ["--grammar-engine", args.grammar_engine])
        for name, path in trees.items()
    }
    runs: dict = {name: {case: [] for case in CASES} for name in trees}
    load = [os.getloadavg()]
    try:
        for _, port in servers.values():
            asyncio.run(_warm(port, args.new_tokens))
        for rep in range(args.reps):
            order = list(trees) if rep % 2 == 0 else list(reversed(trees))
            for name in order:  # a tree's cases back to back: its slowdowns see one drift
                for case in CASES:
                    port = servers[name][1]
                    result = asyncio.run(_case(port, case, args.new_tokens, args.waves))
                    runs[name][case].append(result)
                    print(rep, name, case, result, flush=True)
            load.append(os.getloadavg())
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    from bench.measure import cpu_model  # torch loads only once the runs are over

    results = {
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs ({platform.node()})",
        "load_average_1_5_15_per_rep": [[round(x, 2) for x in triple] for triple in load],
        "model": args.model,
        "grammar_engine": args.grammar_engine,
        "plain_streams": PLAIN,
        "new_tokens": args.new_tokens,
        "waves": args.waves,
        "trees": trees,
        "summary": _summary(runs),
        "runs": runs,
    }
    print(json.dumps(results["summary"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
