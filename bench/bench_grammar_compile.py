"""How long a tool request's grammar takes to compile, per grammar engine, over SmolLM2's 49k
vocabulary: outlines-core (planserve's engine, text/structured.py: the Index over the whole
vocabulary), llguidance (vLLM's default; compiles lazily, so the time includes the first mask)
and xgrammar (SGLang's; precomputes its token masks). Agents send their tools with every
request, so this is latency a client sees on a cache miss.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_grammar_compile.py \
        --out bench/results/grammar_compile_cpu.json

llguidance and xgrammar are not planserve dependencies: an engine that does not import is
skipped (install them beside, e.g. `pip install --no-deps --target DIR llguidance xgrammar
apache-tvm-ffi` and add DIR to PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import tokenizers

from model_service.gguf_file import load_gguf_tokenizer
from model_service.loader import smollm2_path
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


def _outlines(tokenizer, _hf) -> dict:
    compiler = structured.GrammarCompiler(tokenizer.tokenizer_json, tokenizer.eos_token_ids, 49152)
    compiler.compile(structured.StructuredSpec("regex", "a"))  # the vocabulary, built once
    times = {}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiler.compile(structured.StructuredSpec("json_schema", json.dumps(schema)))
        times[name] = time.perf_counter() - start
    return times


def _llguidance(_tokenizer, hf) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    lltok = llguidance.hf.from_tokenizer(hf)
    times = {}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        mask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        assert not matcher.is_error(), matcher.get_error()
        times[name] = time.perf_counter() - start
    return times


def _xgrammar(_tokenizer, hf) -> dict:
    import xgrammar

    compiler = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=49152), cache_enabled=False
    )
    times = {}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiler.compile_json_schema(json.dumps(schema))
        times[name] = time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from transformers import PreTrainedTokenizerFast

    tokenizer = load_gguf_tokenizer(smollm2_path())
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer.tokenizer_json),
        eos_token="<|im_end|>",
    )
    results: dict = {"machine": f"{platform.node()} {os.cpu_count()} CPUs", "seconds": {}}
    for engine, run in (
        ("outlines-core", _outlines),
        ("llguidance", _llguidance),
        ("xgrammar", _xgrammar),
    ):
        try:
            times = run(tokenizer, hf)
        except ImportError as error:
            print(f"{engine}: skipped ({error})")
            continue
        results["seconds"][engine] = {name: round(s, 4) for name, s in times.items()}
        print(engine, results["seconds"][engine], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
