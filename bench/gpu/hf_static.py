"""transformers' static batching of one shape on the same device: a random-weight
LlamaForCausalLM made from a LlamaConfig of the shape (model_service/loading/shapes.py), the
workload's requests in batches of --batch-size, left-padded, greedy, every row generating exactly
its max_new_tokens (min_new_tokens = max_new_tokens: EOS ignored), as bench/peers/hf_generate.py
runs it from a folder. Run by bench/bench_gpu_serve.py as a child process:

    python -m bench.gpu.hf_static --shape llama-1b --workload big --out H.json

The result is rewritten after every batch, so a run stopped at --max-seconds (or killed) still
leaves the batches it finished; `complete` says whether every request ran.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def hf_model(shape: str, device: str, dtype: torch.dtype):
    """The shape as transformers' LlamaForCausalLM, initialized on the device in the dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_service.loading.shapes import DUMMY_SHAPES

    fields = {k: v for k, v in DUMMY_SHAPES[shape].items() if k not in ("architectures",)}
    config = LlamaConfig(**fields)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialized straight in the dtype: no float32 copy
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def run_batch(model, batch, device: str, pad: int) -> int:
    """Generates every request of the batch; returns the new tokens per row."""
    width = max(len(r.prompt_ids) for r in batch)
    ids = [[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch]
    mask = [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch]
    new = max(r.max_new_tokens for r in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor(ids, device=device),
            attention_mask=torch.tensor(mask, device=device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
        )
    return out.shape[1] - width


def run(args, requests, write) -> None:
    import transformers

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    model = hf_model(args.shape, args.device, DTYPES[args.dtype])
    run_batch(model, requests[:1], args.device, pad=0)  # warm-up
    sync()
    result = {"batch_size": args.batch_size, "transformers": transformers.__version__,
              "num_requests": len(requests), "completed": 0, "output_tokens": 0,
              "duration_s": 0.0, "output_tokens_per_s": None, "complete": False}  # fmt: skip
    start = time.perf_counter()
    for first in range(0, len(requests), args.batch_size):
        batch = requests[first : first + args.batch_size]
        generated = run_batch(model, batch, args.device, pad=0)
        sync()
        elapsed = time.perf_counter() - start
        result["completed"] += len(batch)
        result["output_tokens"] += generated * len(batch)
        result["duration_s"] = round(elapsed, 3)
        result["output_tokens_per_s"] = round(result["output_tokens"] / elapsed, 1)
        result["complete"] = result["completed"] == len(requests)
        write(result)
        if elapsed > args.max_seconds:
            break


def main(argv: list[str] | None = None) -> None:
    from bench.gpu.workload import workload_requests

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--workload", default="big", help="a stored workload, or 'dry'")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    def write(result: dict) -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    run(args, workload_requests(args.workload), write)


if __name__ == "__main__":
    main()
