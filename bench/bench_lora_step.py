"""Decode tokens/s of the model service's runner with LoRA adapters beside the base model.

    .venv/bin/python bench/bench_lora_step.py [--model smollm2] [--seqs 8] [--rank 16]

Three runs over the same prompts (random token ids, greedy): the base model with --enable-lora
off; --enable-lora on with every sequence on the base model (what the grouping costs base rows);
every sequence on its own adapter (--max-loras = --seqs; random rank-r adapters on all seven
targets, written as PEFT folders). Each run prefills, then times `--steps` decode steps of every
sequence; the figure is output tokens/s over those steps, the best of --rounds interleaved
rounds. Runner only: no gRPC, no scheduler.
"""
from __future__ import annotations

from model_service import threads

threads.configure()  # as `python -m model_service` does, before torch loads libgomp

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from model_service.config import ModelServiceConfig  # noqa: E402
from model_service.loading.loader import load_model  # noqa: E402
from model_service.lora.targets import TARGET_MODULES, model_targets  # noqa: E402
from model_service.start import build_runner  # noqa: E402
from model_service.step.plan import PlanArrays, SlotRegistration  # noqa: E402

_EMPTY = np.zeros(0, dtype=np.int64)


def write_adapter(folder: str, arch, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder of every target (B not zero), as peft saves one."""
    os.makedirs(folder, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for target, place in model_targets(arch).slices.items():
            parent = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{parent}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, place.in_features, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(place.out_features, rank, generator=generator) * 0.02
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
                   "bias": "none"}, f)


def run(loaded, config, lora_ids, prompts, steps, folders) -> float:
    runner = build_runner(loaded, config)
    for lora_id in sorted(set(lora_ids) - {0}):
        runner.load_adapter(lora_id, f"a{lora_id}", folders[lora_id - 1])
    slots = np.arange(len(prompts))
    blocks_per_seq = -(-(len(prompts[0]) + steps + 1) // config.block_size)
    new = [SlotRegistration(int(s), np.asarray(p, dtype=np.int32), 0, 0.0, 0, 1.0, 0, lora_id=lora_ids[s])
           for s, p in enumerate(prompts)]
    ids = np.arange(1, 1 + len(prompts) * blocks_per_seq, dtype=np.int64)
    counts = np.full(len(prompts), len(prompts[0]))
    runner.execute(PlanArrays(0, new, slots, counts, np.full(len(prompts), blocks_per_seq), ids,
                              _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY))
    ones, zeros = np.ones(len(prompts), dtype=np.int64), np.zeros(len(prompts), dtype=np.int64)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        runner.execute(PlanArrays(step, [], slots, ones, zeros, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY))
    return steps * len(prompts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    base = ModelServiceConfig(model=args.model, num_kv_blocks=1024, max_num_slots=max(16, args.seqs))
    loaded = load_model(base)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, loaded.arch.vocab_size, size=args.prompt_len).tolist() for _ in range(args.seqs)]
    lora = ModelServiceConfig(**{**base.__dict__, "enable_lora": True, "max_loras": args.seqs,
                                 "max_lora_rank": args.rank})
    with tempfile.TemporaryDirectory() as root:
        folders = [os.path.join(root, f"a{i}") for i in range(args.seqs)]
        for i, folder in enumerate(folders):
            write_adapter(folder, loaded.arch, args.rank, seed=i)
        runs = {
            "base, LoRA off": (base, [0] * args.seqs),
            "base rows, LoRA on": (lora, [0] * args.seqs),
            f"{args.seqs} adapters, rank {args.rank}": (lora, list(range(1, args.seqs + 1))),
        }
        results: dict[str, float] = {}
        for _ in range(args.rounds):  # interleaved rounds, the best of each: other load drifts
            for name, (config, lora_ids) in runs.items():
                value = run(loaded, config, lora_ids, prompts, args.steps, folders)
                results[name] = max(results.get(name, 0.0), value)
    print(f"{args.model} {base.resolved_dtype()}, {args.seqs} sequences, decode tokens/s:")
    reference = results["base, LoRA off"]
    for name, value in results.items():
        print(f"  {name:28s} {value:8.1f}  ({value / reference:.2f}x)")


if __name__ == "__main__":
    main()
