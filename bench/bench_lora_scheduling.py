"""The LoRA scheduling cliff (issue 35): the same workload with every request on one of K
adapters, K = 16 over --max-loras 4 against K = 4 over --max-loras 4 (and the base model alone
for reference), through a real scheduler and a real model service. The model is the null model
with a fixed step time, so the figures measure the scheduling rule (places, skips, loads), not
the LoRA arithmetic: median and slowest TTFT, output tokens per second.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_lora_scheduling.py \
        --out bench/results/lora_scheduling.json

Preemptive rotation: add --lora-preempt-after-steps Q (docs/lora.md); each row also reports the
end-to-end latency (arrival to last token) and the scheduler's preemptions. Parking: add
--lora-park-after-steps Q (0: off); each row reports the sequence-steps parked.

Several rules in one run (same load, rows interleaved by rule): --rules drain,park:2,preempt:8
(drain: draining rotation, parking and preemption off; park:Q; preempt:Q), with --cases to pick
the rows of each (base,4,16).

Workload: 256 requests of 64 prompt tokens and 32 new tokens (ignore_eos), arriving every 10 ms,
adapters round robin; null model step 10 ms; --max-num-seqs 64.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import EngineProcess, start_scheduler  # noqa: E402

from planserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc  # noqa: E402


def make_adapters(folder: str, count: int) -> list[str]:
    """`count` rank-16 PEFT folders (all targets) of a small Llama: the null model checks their
    files and keeps no weights."""
    import peft
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    paths = []
    for index in range(count):
        torch.manual_seed(index)
        lora = peft.LoraConfig(r=16, target_modules=targets, init_lora_weights=False)
        path = os.path.join(folder, f"ad{index}")
        peft.get_peft_model(transformers.LlamaForCausalLM(config), lora).save_pretrained(path)
        paths.append(path)
    del model
    return paths


async def one(stub, index: int, adapter: str, start: float, delay_s: float) -> tuple:
    await asyncio.sleep(max(0.0, start + index * delay_s - time.perf_counter()))
    sent = time.perf_counter()
    request = generate_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[(index * 7 + i) % 90 + 5 for i in range(64)]),
        lora_name=adapter,
        stopping=generate_pb2.StoppingCriteria(max_new_tokens=32, ignore_eos=True),
    )
    first, tokens = None, 0
    async for chunk in stub.Generate(request):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - sent
        tokens += len(chunk.token_ids)
    assert first is not None
    return first, tokens, time.perf_counter() - sent


async def run(adapters: list[str], max_loras: int, folder: str, args) -> dict:
    engine = EngineProcess(
        "--model", "null", "--null-step-delay-ms", str(args.step_ms), "--enable-lora",
        "--max-loras", str(max_loras), "--max-cpu-loras", str(max(len(adapters), max_loras)),
    )  # fmt: skip
    modules = tuple(f"{os.path.basename(p)}={p}" for p in adapters)
    server = await start_scheduler(
        engine.address,
        max_num_seqs=64,
        lora_modules=modules,
        lora_max_skipped_steps=args.lora_max_skipped_steps,
        lora_rotate_after_steps=args.lora_rotate_after_steps,
        lora_preempt_after_steps=args.lora_preempt_after_steps,
        lora_park_after_steps=args.lora_park_after_steps,
    )
    try:
        names = [os.path.basename(p) for p in adapters] or [""]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)
            start = time.perf_counter() + 0.2
            results = await asyncio.gather(
                *(
                    one(stub, i, names[i % len(names)], start, args.interval_ms / 1000)
                    for i in range(args.num_requests)
                )
            )
            elapsed = time.perf_counter() - start
        preemptions = server.loop.scheduler.num_preemptions_total
        parked = server.loop.scheduler.loras.turns.num_parked_total
    finally:
        await server.stop(grace_s=1)
        engine.stop()
    ttft = sorted(r[0] for r in results)
    e2e = sorted(r[2] for r in results)
    return {
        "adapters": len(adapters),
        "max_loras": max_loras,
        "lora_max_skipped_steps": args.lora_max_skipped_steps,
        "lora_rotate_after_steps": args.lora_rotate_after_steps,
        "lora_preempt_after_steps": args.lora_preempt_after_steps,
        "lora_park_after_steps": args.lora_park_after_steps,
        "median_ttft_ms": round(statistics.median(ttft) * 1000, 1),
        "p99_ttft_ms": round(ttft[int(0.99 * (len(ttft) - 1))] * 1000, 1),
        "max_ttft_ms": round(ttft[-1] * 1000, 1),
        "output_tok_s": round(sum(r[1] for r in results) / elapsed, 1),
        "median_e2e_ms": round(statistics.median(e2e) * 1000, 1),
        "max_e2e_ms": round(e2e[-1] * 1000, 1),
        "preemptions": preemptions,
        "parked_sequence_steps": parked,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def median_schedule_ms(scheduler) -> float:
    """Median time of schedule() (ms) over 200 steps, each updated with a fake result."""
    from scheduler.factories import fake_result

    times = []
    for _ in range(200):
        started = time.perf_counter()
        plan = scheduler.schedule()
        times.append(time.perf_counter() - started)
        scheduler.update(plan, fake_result(plan))
    return statistics.median(times) * 1000


def skip_cost() -> float:
    """Median schedule() time (ms) with 1,000 waiting requests of an adapter that has no place:
    each step skips (pops and puts back) the most it may, MAX_SKIPS_PER_STEP."""
    from scheduler.test_lora_scheduling import Loads, lora_request, lora_scheduler, step

    scheduler = lora_scheduler(
        max_loras=1, max_cpu_loras=8, num_blocks=4096, max_num_seqs=256, max_num_batched_tokens=512
    )
    loads = Loads(scheduler)
    scheduler.add_request(lora_request("A", max_new_tokens=10_000))
    for _ in range(3):
        step(scheduler, loads, 1)
    for _ in range(1000):
        scheduler.add_request(lora_request("B", max_new_tokens=4))
    return median_schedule_ms(scheduler)


def with_rule(args: argparse.Namespace, rule: str) -> argparse.Namespace:
    """`args` with one rule's flags: drain (draining rotation alone), park:Q, preempt:Q."""
    kind, _, quantum = rule.partition(":")
    flags = dict(vars(args), lora_park_after_steps=0, lora_preempt_after_steps=0)
    if kind == "park":
        flags["lora_park_after_steps"] = int(quantum)
    elif kind == "preempt":
        flags["lora_preempt_after_steps"] = int(quantum)
    elif kind != "drain":
        raise SystemExit(f"--rules: {rule!r} is not drain, park:Q or preempt:Q")
    return argparse.Namespace(**flags)


def park_cost(num_adapters: int, park: int) -> tuple[float, int, int]:
    """Median schedule() time (ms), the sequences running and those in a step, with 128 long
    requests on `num_adapters` adapters (0: the base model) over 4 places; with parking most
    of them sit each step out."""
    from scheduler.factories import make_facts, make_request, make_scheduler
    from scheduler.test_lora_scheduling import IDS, Loads, step

    from scheduler_service.core.loras import LoraCapacity

    capacity = LoraCapacity(max_loras=4, max_lora_rank=16, max_cpu_loras=16)
    facts = make_facts(
        num_blocks=16384, block_size=16, max_num_slots=256, max_model_len=8192, lora=capacity
    )
    scheduler = make_scheduler(
        facts=facts,
        max_model_len=8192,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        lora_park_after_steps=park,
    )
    loads = Loads(scheduler)
    names = [f"x{i}" for i in range(num_adapters)]
    IDS.update({name: 100 + i for i, name in enumerate(names)})
    for i in range(128):
        name = names[i % num_adapters] if num_adapters else ""
        lora_id = IDS[name] if name else 0
        request = make_request(
            lora_name=name, lora_id=lora_id, max_new_tokens=4000, ignore_eos=True
        )
        scheduler.add_request(request)
    for _ in range(64):
        step(scheduler, loads, 4)
    cost = median_schedule_ms(scheduler)
    return cost, len(scheduler.running), len(scheduler.schedule().requests)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--lora-max-skipped-steps", type=int, default=32)
    parser.add_argument("--lora-rotate-after-steps", type=int, default=8)
    parser.add_argument("--lora-preempt-after-steps", type=int, default=0)
    parser.add_argument("--lora-park-after-steps", type=int, default=1)
    parser.add_argument("--rules", default=None, help="e.g. drain,park:2,preempt:8 (one run)")
    parser.add_argument("--cases", default="base,4,16", help="rows of each rule with --rules")
    parser.add_argument("--only", choices=("base", "4", "16"), default=None, help="one row only")
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-cost", action="store_true", help="only the skip cost per step")
    parser.add_argument("--park-cost", action="store_true", help="only parking's cost per step")
    args = parser.parse_args()
    if args.skip_cost:
        print(f"schedule() with 1,000 skipped requests waiting: {skip_cost():.3f} ms (median)")
        return
    if args.park_cost:
        for adapters in (0, 4, 16):
            cost, running, in_step = park_cost(adapters, args.lora_park_after_steps)
            print(
                f"schedule(), 128 requests on {adapters} adapters over 4 places: {cost:.3f} ms"
                f" ({running} running, {in_step} in the step)"
            )
        return
    with tempfile.TemporaryDirectory() as folder:
        paths = make_adapters(folder, 16)
        cases = {"base": [], "4": paths[:4], "16": paths}
        rows = []
        if args.rules is None:
            for name, adapters in cases.items():
                if args.only in (None, name):
                    rows.append(await run(adapters, 4, folder, args))
        else:
            for rule in args.rules.split(","):
                rule_args = with_rule(args, rule)
                for name in args.cases.split(","):
                    rows.append({"rule": rule, **await run(cases[name], 4, folder, rule_args)})
    load = os.getloadavg()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), ""
    )
    report = {"cpu": model, "load_average": load, "workload": vars(args), "rows": rows}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    asyncio.run(main())
