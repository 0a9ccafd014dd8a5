"""Decode step time of the LoRA paths side by side, a step of each in turn (shared cores drift).

    .venv/bin/python bench/bench_lora_paths.py [--steps 24] [--seqs 8]

SmolLM2 (the default dtype: bf16 on the CPU), 8 sequences of 64 prompt tokens (--seqs), rank-16
adapters on all 7 targets, one adapter per sequence (8 at most); five runners stepped in turn:
the base model (native decoder loop); the sequences on 8 adapters inside the native decoder
loop (each row against its own adapter's blocks of the stack, cython_ext/csrc/lora_rows.h); the
stacked products (model_service/lora/stacked.py: every row through every loaded adapter, masked)
in the Python layers (a second copy of the model with decoder_loop=python: the path before the
native loop took adapters); the per-adapter loop (lora/grouping.py, the path before the stacks:
the store's stack withheld); one adapter on every row, native loop. Prints each one's median
ms per step (the first two steps dropped), its tokens/s and its ratio to the base, then the time
to build the 8 adapters' stack (what each load and evict pays).
"""

from __future__ import annotations

from model_service import threads

threads.configure()  # as `python -m model_service` does, before torch loads libgomp

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lora_step import _EMPTY, write_adapter  # noqa: E402

from model_service.config import ModelServiceConfig  # noqa: E402
from model_service.loading.loader import load_model  # noqa: E402
from model_service.lora.stacked import LoadedStack  # noqa: E402
from model_service.start import build_runner  # noqa: E402
from model_service.step.plan import PlanArrays, SlotRegistration  # noqa: E402

PROMPT, ADAPTERS = 64, 8


def prefilled(loaded, config, lora_ids, prompts, folders, steps):
    runner = build_runner(loaded, config)
    seqs = len(prompts)
    for lora_id in sorted(set(lora_ids) - {0}):
        runner.load_adapter(lora_id, f"a{lora_id}", folders[lora_id - 1])
    blocks = -(-(PROMPT + steps + 2) // config.block_size)
    new = [
        SlotRegistration(s, np.asarray(p, dtype=np.int32), 0, 0.0, 0, 1.0, 0, lora_id=lora_ids[s])
        for s, p in enumerate(prompts)
    ]
    runner.execute(
        PlanArrays(
            0,
            new,
            np.arange(seqs),
            np.full(seqs, PROMPT),
            np.full(seqs, blocks),
            np.arange(1, 1 + seqs * blocks, dtype=np.int64),
            _EMPTY,
            _EMPTY,
            _EMPTY,
            _EMPTY,
            _EMPTY,
        )
    )
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seqs", type=int, default=8)
    args = parser.parse_args()
    seqs = args.seqs
    base = ModelServiceConfig(model="smollm2", num_kv_blocks=1024 * max(1, seqs // 8))
    base = ModelServiceConfig(**{**base.__dict__, "max_num_slots": max(16, seqs)})
    loaded = load_model(base)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, loaded.arch.vocab_size, size=PROMPT).tolist() for _ in range(seqs)]
    lora = ModelServiceConfig(
        **{**base.__dict__, "enable_lora": True, "max_loras": ADAPTERS, "max_lora_rank": 16}
    )
    python = ModelServiceConfig(**{**lora.__dict__, "decoder_loop": "python"})
    eight = [1 + s % ADAPTERS for s in range(seqs)]
    with tempfile.TemporaryDirectory() as root:
        folders = [os.path.join(root, f"a{i}") for i in range(ADAPTERS)]
        for i, folder in enumerate(folders):
            write_adapter(folder, loaded.arch, 16, seed=i)
        runners = {
            "base (native loop)": prefilled(loaded, base, [0] * seqs, prompts, folders, args.steps),
            "8 adapters, native loop": prefilled(loaded, lora, eight, prompts, folders, args.steps),
            "8 adapters, stacked, python layers": prefilled(
                load_model(python), python, eight, prompts, folders, args.steps
            ),
            "8 adapters, per-adapter loop": prefilled(
                loaded, lora, eight, prompts, folders, args.steps
            ),
            "1 adapter on all rows, native loop": prefilled(
                loaded, lora, [1] * seqs, prompts, folders, args.steps
            ),
        }
    runners["8 adapters, per-adapter loop"].adapters._stack = None  # steps then take the loop
    ones, zeros, slots = (
        np.ones(seqs, dtype=np.int64),
        np.zeros(seqs, dtype=np.int64),
        np.arange(seqs),
    )
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(1, args.steps + 1):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.execute(
                PlanArrays(
                    step, [], slots, ones, zeros, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY
                )
            )
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
    reference = medians["base (native loop)"]
    for name, ms in medians.items():
        print(
            f"  {name:36s} {ms:7.1f} ms/step {seqs / ms * 1e3:7.1f} tok/s ({reference / ms:.2f}x)"
        )
    store = runners["8 adapters, native loop"].adapters
    adapters = tuple(store.snapshot()[i] for i in range(1, ADAPTERS + 1))
    start = time.perf_counter()
    LoadedStack(adapters, store._stack_isa, store._targets.slices)
    print(f"  stack build, 8 adapters: {(time.perf_counter() - start) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
