"""Peak host memory while loading a checkpoint: a synthetic ~1.2B-parameter Llama (TinyLlama-1.1B's
shape: hidden 2048, 22 layers, 32 query / 4 KV heads, MLP 5632; SmolLM2's vocabulary of 49152 so
its tokenizer fits; untied) written as
bf16 safetensors in two shards with model.safetensors.index.json, random weights, then loaded by
`model_service.loading.loader.load_model` in a fresh process per case, bfloat16, at tensor parallel 1 and
as rank 0 of 2 (that rank's share only: the collectives are not needed to load).

Measured: RssAnon (anonymous memory: the memory-mapped safetensors pages count in RSS but not
here), sampled every 2 ms by a thread in the loading process; reported as the peak increase over
the process's RssAnon before loading, next to the bytes of the weights it ends up holding.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_load.py            # writes /tmp's checkpoint once
    PYTHONPATH=protos:. .venv/bin/python bench/bench_load.py --cases tp1 tp2 tp1-int8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "protos")]

RESULTS = os.path.join(ROOT, "bench", "results", "load.json")
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=2048,
              intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
              max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              torch_dtype="bfloat16")


def _shapes() -> dict[str, tuple[int, ...]]:
    c = CONFIG
    d = c["hidden_size"] // c["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], c["hidden_size"]),
              "model.norm.weight": (c["hidden_size"],), "lm_head.weight": (c["vocab_size"], c["hidden_size"])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (c["num_attention_heads"] * d, c["hidden_size"]),
            p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * d, c["hidden_size"]),
            p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * d, c["hidden_size"]),
            p + "self_attn.o_proj.weight": (c["hidden_size"], c["num_attention_heads"] * d),
            p + "mlp.gate_proj.weight": (c["intermediate_size"], c["hidden_size"]),
            p + "mlp.up_proj.weight": (c["intermediate_size"], c["hidden_size"]),
            p + "mlp.down_proj.weight": (c["hidden_size"], c["intermediate_size"]),
            p + "input_layernorm.weight": (c["hidden_size"],),
            p + "post_attention_layernorm.weight": (c["hidden_size"],),
        })
    return shapes


def write_checkpoint(folder: str) -> None:
    """Two bf16 shards and their index, written a tensor at a time (random, std 0.02)."""
    import torch
    from safetensors.torch import save_file

    from model_service.loading.gguf_file import load_gguf_tokenizer
    from model_service.loading.loader import smollm2_path

    os.makedirs(folder, exist_ok=True)
    names = sorted(_shapes().items())
    half = len(names) // 2
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for index, part in enumerate((names[:half], names[half:])):
        file = f"model-{index + 1:05d}-of-00002.safetensors"
        tensors = {name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16) for name, shape in part}
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(load_gguf_tokenizer(smollm2_path()).tokenizer_json)


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def measure_in_this_process(folder: str, case: str) -> dict:
    """Load the checkpoint as `case` says, sampling RssAnon; returns the figures."""
    import torch

    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model
    from model_service.models.parallel import RankShare
    from model_service.kernels.quant import weight_bytes

    world_size = 2 if case.startswith("tp2") else 1
    quantization = "int8" if case.endswith("int8") else "none"
    baseline = _rss_anon_kib()
    peak = [baseline]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon_kib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    config = ModelServiceConfig(model=folder, dtype="bfloat16", quantization=quantization, num_kv_blocks=16)
    loaded = load_model(config, RankShare(0, world_size, vocab_parallel=quantization == "none"))
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    weights = weight_bytes(loaded.model)
    final = _rss_anon_kib()
    return {
        "case": case, "tensor_parallel_size": world_size, "rank": 0, "quantization": quantization,
        "load_seconds": round(seconds, 2), "weight_bytes": weights,
        "peak_rss_anon_increase_bytes": (peak[0] - baseline) * 1024,
        "final_rss_anon_increase_bytes": (final - baseline) * 1024,
        "peak_over_weights": round((peak[0] - baseline) * 1024 / weights, 3),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default="/tmp/planserve-bench-load-1b")
    parser.add_argument("--cases", nargs="+", default=["tp1", "tp2", "tp1-int8"],
                        choices=["tp1", "tp2", "tp1-int8", "tp2-int8"])
    parser.add_argument("--label", default="after (tensor by tensor, rank slices)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one case in this process
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure_in_this_process(args.folder, args.one)), flush=True)
        return
    if not os.path.isfile(os.path.join(args.folder, "model.safetensors.index.json")):
        print(f"writing the synthetic checkpoint to {args.folder} ...", flush=True)
        write_checkpoint(args.folder)
    from bench.measure import cpu_model

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "protos")]))
    runs = []
    for case in args.cases:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--folder", args.folder, "--one", case],
                             capture_output=True, text=True, env=env, check=True).stdout
        run = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
        print(f"{case}: weights {run['weight_bytes'] / 2**30:.2f} GiB, peak RssAnon +"
              f"{run['peak_rss_anon_increase_bytes'] / 2**30:.2f} GiB ({run['peak_over_weights']}x), "
              f"{run['load_seconds']} s", flush=True)
        runs.append(run)
    from bench.measure import save_run

    save_run(RESULTS, args.label, {"cpu": cpu_model(), "checkpoint": "synthetic 1.2B Llama (TinyLlama-1.1B layers, vocab 49152), bf16, 2 shards",
                                   "runs": runs})


if __name__ == "__main__":
    main()
