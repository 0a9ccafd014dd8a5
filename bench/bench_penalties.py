"""Penalties, bias and min-token suppression (model_service/step/logits.py apply_processing) for
P sampled rows at once, each row with its own tokens, on the CPU or a GPU. A plain script.

    PYTHONPATH=protos:. python bench/bench_penalties.py [--device cpu|cuda] [--rows 1,8,64]
        [--vocab 49152] [--prompt 200] [--output 100] [--reps 30] [--reference MODULE:FUNCTION]

Every row asks repetition 1.1, presence 0.5 and frequency 0.3, with two biased tokens; figures
are the median milliseconds of --reps calls (device synchronized around each) after 3 warm-up
calls. --reference times another implementation with the same signature beside it: the
row-by-row rule the tests keep (test_ms_logits:row_by_row, with tests and tests/model_service on
PYTHONPATH) for before/after figures.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.gpu.ceiling import median_ms  # noqa: E402
from model_service.step.logits import apply_processing  # noqa: E402
from model_service.step.plan import LogitsProcessing  # noqa: E402
from model_service.step.slot_table import SlotTable  # noqa: E402


def rows_of(count: int, vocab: int, prompt: int, output: int) -> SlotTable:
    rng = np.random.default_rng(count)
    table = SlotTable(max_num_slots=count, max_model_len=prompt + output, block_size=16)
    processing = LogitsProcessing(
        num_prompt_tokens=prompt, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=0.3, logit_bias=((11, 2.0), (12, -3.0)))  # fmt: skip
    for slot in range(count):
        tokens = rng.integers(0, vocab, size=prompt + output).astype(np.int32)
        table.register(slot, tokens, 0, 1.0, 0, 1.0, 0, processing)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--output", type=int, default=100)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--reference", help="MODULE:FUNCTION timed beside apply_processing")
    args = parser.parse_args()
    device = torch.device(args.device)
    paths = {"apply_processing": apply_processing}
    if args.reference:
        module, name = args.reference.split(":")
        paths["reference"] = getattr(importlib.import_module(module), name)
    for count in (int(r) for r in args.rows.split(",")):
        table = rows_of(count, args.vocab, args.prompt, args.output)
        logits = torch.randn(count, args.vocab, device=device)
        rows = slots = np.arange(count)
        figures = {
            name: median_ms(
                lambda f=f, x=logits, r=rows, s=slots, t=table: f(x, r, s, t),
                device.type,
                args.reps,
            )
            for name, f in paths.items()
        }
        print(f"rows {count}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in figures.items()))


if __name__ == "__main__":
    main()
