"""How long a tool request's grammar takes to compile, and what each step's mask then costs, per
grammar engine, over SmolLM2's 49k vocabulary: planserve's two engines through its own
GrammarCompiler (`--grammar-engine outlines`: outlines-core's Index over the whole vocabulary;
`--grammar-engine llguidance`: compiled lazily, so its time includes the first mask), and
xgrammar (SGLang's; precomputes its token masks) when it and transformers are installed.
Agents send their tools with every request, so the compile is latency a client sees on a cache
miss; the mask is written for every constrained sequence every step, on the event loop.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_grammar_compile.py \
        --out bench/results/grammar_compile_cpu.json

The per-step cost walks each grammar for up to 64 tokens, taking the lowest allowed token each
step (as the scheduler's unit tests' fake engine does), and reports the mean time of one
`write_mask` plus `accept`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import tokenizers

from model_service.loading.gguf_file import load_gguf_tokenizer
from model_service.loading.loader import smollm2_path
from scheduler_service.text import structured

WEATHER = {
    "type": "object",
    "required": ["city"],
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
}
SEARCH = {
    "type": "object",
    "required": ["query", "filters"],
    "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "filters": {
            "type": "object",
            "required": ["year"],
            "properties": {
                "year": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}


def _call(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "properties": {"name": {"const": name}, "arguments": parameters},
    }


CALLS = {"anyOf": [_call("get_weather", WEATHER), _call("search", SEARCH)]}
SCHEMAS = {  # what tool_requests.ToolPlan.grammar_schema builds
    "named tool (flat)": WEATHER,
    "named tool (nested)": SEARCH,
    "required, 2 tools, one call": {"type": "array", "items": CALLS, "minItems": 1, "maxItems": 1},
    "required, 2 tools, parallel": {"type": "array", "items": CALLS, "minItems": 1},
    "parameters {type: object} (any object)": {"type": "object"},
}


def _mean_step_s(guide, num_words: int, steps: int = 64) -> float:
    """Mean seconds of one step's mask and accept, walking the lowest allowed token."""
    row = np.zeros(num_words, dtype="<u4")
    spent, taken = 0.0, 0
    for _ in range(steps):
        start = time.perf_counter()
        row[:] = 0
        guide.write_mask(row)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        if guide.is_final or not len(allowed):
            break
        guide.accept(int(allowed[0]))
        spent += time.perf_counter() - start
        taken += 1
    return spent / max(taken, 1)


def _planserve(engine: str):
    def run(tokenizer) -> tuple[dict, dict]:
        compiler = structured.GrammarCompiler(
            tokenizer.tokenizer_json, tokenizer.eos_token_ids, 49152, engine=engine
        )
        compiler.compile(structured.StructuredSpec("regex", "a"))  # the vocabulary, built once
        times, steps = {}, {}
        for name, schema in SCHEMAS.items():
            start = time.perf_counter()
            spec = structured.StructuredSpec("json_schema", json.dumps(schema))
            grammar = compiler.compile(spec)
            guide = grammar.new_guide()
            guide.write_mask(np.zeros(compiler.num_words, dtype="<u4"))  # the first mask
            times[name] = time.perf_counter() - start
            steps[name] = _mean_step_s(grammar.new_guide(), compiler.num_words)
        return times, steps

    return run


def _xgrammar(tokenizer) -> tuple[dict, dict]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer.tokenizer_json),
        eos_token="<|im_end|>",
    )
    compiler = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=49152), cache_enabled=False
    )
    times = {}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiler.compile_json_schema(json.dumps(schema))
        times[name] = time.perf_counter() - start
    return times, {}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    tokenizer = load_gguf_tokenizer(smollm2_path())
    results: dict = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs",
        "seconds": {},
        "step_seconds": {},
    }
    for engine, run in (
        ("outlines-core", _planserve("outlines")),
        ("llguidance", _planserve("llguidance")),
        ("xgrammar", _xgrammar),
    ):
        try:
            times, steps = run(tokenizer)
        except ImportError as error:
            print(f"{engine}: skipped ({error})")
            continue
        results["seconds"][engine] = {name: round(s, 4) for name, s in times.items()}
        results["step_seconds"][engine] = {name: round(s, 6) for name, s in steps.items()}
        print(engine, results["seconds"][engine], results["step_seconds"][engine], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
