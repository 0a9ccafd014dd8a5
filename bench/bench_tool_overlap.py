"""What one agent costs the other clients: 15 plain chat requests (128 greedy tokens each,
ignore_eos, sent at once) alone, then beside a client that sends named-tool requests one after
another (each generated under its tool's grammar, which today turns overlap off while it runs),
then beside a client that sends plain 40-token requests one after another (the control: the
same arrivals without a grammar), each greedy and sampled (temperature 1), and alone with
--no-overlap for reference. Reports the 15 requests' output tokens/s in each case.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_tool_overlap.py --model tiny \
        [--grammar-engine llguidance] --out bench/results/tool_overlap_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time

import openai

HTTP_LINE = "PLANSERVE_HTTP_PORT="
PLAIN, NEW_TOKENS = 15, 128
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


def _serve(model: str, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [
        sys.executable,
        "-m",
        "tools",
        "serve",
        "--model",
        model,
        "--port",
        "0",
        "--http-port",
        "0",
        "--metrics-port",
        "-1",
        *extra,
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    for line in process.stdout:
        if line.startswith(HTTP_LINE):
            process.http_port = int(line[len(HTTP_LINE) :])  # type: ignore[attr-defined]
            return process
    raise RuntimeError("planserve serve did not start")


async def _plain(client, model: str, index: int) -> int:
    result = await client.chat.completions.create(
        model=model,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": f"Tell me a story about number {index}."}],
    )
    return result.usage.completion_tokens


async def _tool_call(client, model: str, temperature: float) -> None:
    await client.chat.completions.create(
        model=model,
        max_tokens=40,
        temperature=temperature,
        messages=[{"role": "user", "content": "Time?"}],
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )


async def _short_plain(client, model: str, temperature: float) -> None:
    await client.chat.completions.create(
        model=model,
        max_tokens=40,
        temperature=temperature,
        messages=[{"role": "user", "content": "Time?"}],
        extra_body={"ignore_eos": True},
    )


async def _beside(send, stop: asyncio.Event) -> int:
    """Requests one after another until `stop`; how many were made."""
    calls = 0
    while not stop.is_set():
        await send()
        calls += 1
    return calls


async def _run(port: int, beside: str, temperature: float) -> dict:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600
    )
    model = (await client.models.list()).data[0].id
    await _plain(client, model, -1)  # warm-up (and the tool's grammar, compiled once)
    sends = {
        "tool": lambda: _tool_call(client, model, temperature),
        "plain": lambda: _short_plain(client, model, temperature),
    }
    send = sends.get(beside)
    if send is not None:
        await send()  # warm (a tool's grammar compiled) before the clock starts
    stop = asyncio.Event()
    agent = asyncio.ensure_future(_beside(send, stop)) if send is not None else None
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(_plain(client, model, i) for i in range(PLAIN))))
    seconds = time.perf_counter() - start
    stop.set()
    calls = await agent if agent is not None else 0
    return {
        "plain_output_tok_s": round(tokens / seconds, 1),
        "seconds": round(seconds, 2),
        "requests_beside": calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--grammar-engine", default="outlines", choices=("outlines", "llguidance"))
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs",
        "model": args.model,
        "grammar_engine": args.grammar_engine,
    }
    cases = (
        ("alone", [], "", 0.0),
        ("beside greedy tool requests", [], "tool", 0.0),
        ("beside greedy plain requests", [], "plain", 0.0),
        ("beside sampled tool requests", [], "tool", 1.0),
        ("beside sampled plain requests", [], "plain", 1.0),
        ("alone, no-overlap", ["--no-overlap"], "", 0.0),
    )
    for label, extra, beside, temperature in cases:
        server = _serve(args.model, [*extra, "--grammar-engine", args.grammar_engine])
        try:
            results[label] = asyncio.run(_run(server.http_port, beside, temperature))
        finally:
            server.terminate()
            server.wait(timeout=60)
        print(label, results[label], flush=True)
    base = results["alone"]["plain_output_tok_s"]
    for label, _, beside, _ in cases:
        if not beside:
            continue
        results[f"slowdown {label}"] = round(1 - results[label]["plain_output_tok_s"] / base, 3)
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
