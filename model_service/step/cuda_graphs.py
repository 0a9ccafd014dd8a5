"""Decode steps on CUDA replayed from captured CUDA graphs, one graph per padded batch size.

Why: a SmolLM2-135M step launches ~1,200 kernels (30 layers of ~40 ops). On an H100 the GPU was
busy ~3.6 ms of a 27-48 ms bf16 decode step (torch.profiler; bench/results/cuda_forward.json):
the step was the host launching kernels one by one. A graph launches them all in one call.

What is captured: the model's forward for a decode-only step (every sequence one new row whose
logits are sampled: no prompt chunk, prompt logprobs or draft rows), once per size in BUCKETS up to
max_num_slots, largest first, all in one memory pool. A step of B sequences replays the smallest
size >= B; the rows after B are padding: num_scheduled 0, so the attention kernel skips them, and
their K/V rows go to the reserved block 0, which no block table reads. Every other step runs
eagerly, as before.

Inputs and logits live in static device buffers (each size uses the first rows of them); a step
writes its host arrays into a pinned staging buffer, copies it over in two transfers, and replays.
Each graph copies its logits into the one static output, so nothing it allocated outlives its
capture and the next (smaller) capture reuses the pool's memory: the graphs hold about one
largest decode step's activations (logged at start as decode_graphs_captured), not one per size.

Where graphs are not used (`unsupported_reason`): off CUDA; with cuda_graphs "off"; where
attention runs the torch path (it sizes its gather from the step's longest context on the host,
which a graph would freeze); under tensor parallelism (the ranks would have to replay in
lockstep; not built).

Numerics: a padded size runs the GEMMs at its own row count, and cuBLAS picks its kernels by shape,
so a row's logits may differ in the last bits from an eager step of B rows. cuBLAS is no more
batch invariant eagerly: on CUDA, batch invariance holds for the attention kernel only.
"""

from __future__ import annotations

import numpy as np
import structlog
import torch

from model_service.attention.kv_cache import KVCache
from model_service.attention.paged import build_attention_metadata, cuda_path
from model_service.loading.loaded import LoadedModel

log = structlog.get_logger(__name__)
# The captured batch sizes (and max_num_slots), as vLLM's: every size up to 8, then steps of 16.
BUCKETS = (1, 2, 4, 8, *range(16, 257, 16))


def unsupported_reason(
    requested: str, device: torch.device, kv_cache: KVCache, tensor_parallel_size: int
) -> str | None:
    """Why decode steps run eagerly, or None where they are captured (`requested`: the config's
    cuda_graphs, "auto" or "off")."""
    if device.type != "cuda":
        return f"device {device.type}"
    if requested == "off":
        return "cuda_graphs=off"
    attention = cuda_path(kv_cache.k)
    if attention != "triton":
        return f"attention runs {attention}"
    if tensor_parallel_size > 1:
        return "tensor parallel"
    return None


def capture(
    requested: str,
    loaded: LoadedModel,
    kv_cache: KVCache,
    block_size: int,
    max_num_slots: int,
    max_blocks_per_seq: int,
) -> tuple[DecodeGraphs | None, str]:
    """The model's decode graphs over `kv_cache` (captured now) and the path Describe reports,
    or None and why (`requested`: the config's cuda_graphs, "auto" or "off")."""
    device = kv_cache.k.device
    reason = unsupported_reason(requested, device, kv_cache, loaded.tensor_parallel_size)
    if reason is not None:
        return None, f"none ({reason})"
    before = torch.cuda.memory_reserved(device)
    graphs = DecodeGraphs(loaded.model, kv_cache, block_size, max_num_slots, max_blocks_per_seq)
    held = torch.cuda.memory_reserved(device) - before
    log.info("decode_graphs_captured", sizes=len(graphs.sizes), bytes=held)
    return graphs, f"decode, batch sizes {','.join(map(str, graphs.sizes))}"


class DecodeGraphs:
    """The captured decode step of each size, and the static buffers they read."""

    def __init__(self, model, kv_cache, block_size: int, max_rows: int, max_blocks_per_seq: int):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.sizes = [b for b in BUCKETS if b < max_rows] + [max_rows]
        device = kv_cache.k.device
        # Staging rows: input ids, positions, slot mapping, context lengths, num_scheduled.
        self.staging = torch.zeros((5, max_rows), dtype=torch.int64).pin_memory()
        self.staged_tables = torch.zeros((max_rows, max_blocks_per_seq), dtype=torch.int64)
        self.staged_tables = self.staged_tables.pin_memory()
        self.inputs = torch.zeros((5, max_rows), dtype=torch.int64, device=device)
        self.tables = torch.zeros((max_rows, max_blocks_per_seq), dtype=torch.int64, device=device)
        self.rows = torch.arange(max_rows, device=device)  # query starts and logits rows alike
        self.replays = 0  # steps served by a replay (tests, and the note's figures)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits = torch.empty(0)  # [max_rows, vocab] once the first (largest) warm-up ran
        self.inputs[3:5] = 1  # warm-up and capture: every row a decode at position 0 of block 0
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller reuse its pool's memory
            self._capture(size, pool)

    def _args(self, size: int):
        ids, positions, slots, context_lens, num_scheduled = self.inputs[:, :size]
        # max_context_len is the torch path's alone; the kernel reads context_lens on the device.
        meta = build_attention_metadata(
            slots, self.rows[:size], num_scheduled, context_lens, self.tables[:size],
            self.block_size, 1, self.tables.shape[1] * self.block_size,
        )  # fmt: skip
        return ids, positions, meta, self.kv_cache, self.rows[:size]

    def _capture(self, size: int, pool) -> None:
        args = self._args(size)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            warm = self.model(*args)  # warm-up: Triton compiles, cuBLAS chooses, nothing recorded
        torch.cuda.current_stream().wait_stream(side)
        if self.logits.numel() == 0:
            self.logits = torch.empty((self.rows.numel(), warm.shape[1]), dtype=warm.dtype,
                                      device=warm.device)  # fmt: skip
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            self.logits[:size].copy_(self.model(*args))
        self.graphs[size] = graph

    def run(self, x, num_scheduled: np.ndarray, logits_indices: np.ndarray) -> torch.Tensor | None:
        """The step's logits [B, vocab] from a replay, or None where the step must run eagerly."""
        count = num_scheduled.size
        if (
            x.max_query_len != 1
            or count > self.sizes[-1]
            or not np.array_equal(logits_indices, np.arange(count))  # every row sampled
            or x.block_tables.shape[1] > self.tables.shape[1]
        ):
            return None
        size = next(b for b in self.sizes if b >= count)
        host = self.staging.numpy()
        host[:, count:size] = 0  # padding rows: token 0 at position 0, slot 0, nothing scheduled
        for row, values in enumerate((x.input_ids, x.positions, x.slot_mapping, x.context_lens)):
            host[row, :count] = values[:count]
        host[4, :count] = 1
        width = x.block_tables.shape[1]
        self.staged_tables.numpy()[:count, :width] = x.block_tables[:count]
        self.inputs[:, :size].copy_(self.staging[:, :size], non_blocking=True)
        self.tables[:count, :width].copy_(self.staged_tables[:count, :width], non_blocking=True)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[:count]
