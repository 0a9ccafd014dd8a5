"""The `transformers` peer: static batches of `generate`, as a user would write it.

    python -m bench.peers.hf_generate --model bench/peers/.work/smollm2-hf --dtype bfloat16

Prompts (token ids of a stored workload) go in batches of --batch-size, left-padded, greedy,
`min_new_tokens = max_new_tokens` so EOS cannot end a row early (EOS ignored). Every request of a
batch finishes when the batch does, so its end-to-end latency is the batch's time (and a request's
time to first token is not observable: the whole batch streams nothing). Prints one JSON object.
Needs transformers (the `peers` extra).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from bench.load import workloads

    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    requests = workloads.load(args.workload)

    def run_batch(batch):
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch]
        )
        new = max(r.max_new_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
        return out.shape[1] - width

    run_batch(requests[:1])  # warm-up
    start = time.perf_counter()
    e2e, output_tokens = [], 0
    for first in range(0, len(requests), args.batch_size):
        batch = requests[first : first + args.batch_size]
        generated = run_batch(batch)
        output_tokens += generated * len(batch)
        e2e += [time.perf_counter() - start] * len(batch)  # all sent at t=0, done with their batch
    elapsed = time.perf_counter() - start
    print(json.dumps(_result(args, requests, elapsed, output_tokens, e2e)))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--workload", default="peer")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    return parser.parse_args(argv)


def _result(args, requests, elapsed: float, output_tokens: int, e2e: list) -> dict:
    """The run as bench/load/report.py writes a planserve run."""
    from bench.load import report

    return {
        "engine": f"transformers-{args.dtype}",
        "workload": args.workload,
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "runs": [
            {
                "request_rate": None,
                "num_requests": len(requests),
                "completed": len(requests),
                "failed": 0,
                "duration_s": round(elapsed, 3),
                "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
                "output_tokens": output_tokens,
                "output_tokens_per_s": round(output_tokens / elapsed, 2),
                "requests_per_s": round(len(requests) / elapsed, 3),
                "ttft_ms": report._stats([]),
                "itl_ms": report._stats([]),
                "tpot_ms": report._stats([]),
                "e2e_ms": report._stats(e2e),
            }
        ],
        "machine": report.machine_note(),
    }


if __name__ == "__main__":
    main()
