"""Every step on CUDA replayed from captured CUDA graphs, one graph per token bucket.

Why: a SmolLM2-135M step launches ~1,200 kernels (30 layers of ~40 ops). On an H100 the GPU was
busy ~3.6 ms of a 27-48 ms bf16 decode step (torch.profiler; bench/results/cuda_forward.json):
the step was the host launching kernels one by one. A graph launches them all in one call. Decode
steps alone were captured at first; steps carrying a prompt chunk then ran eagerly and took about
half of a served run's wall time (docs/benchmarks.md), so now every step is.

What is captured: the model's whole forward, attention kernel included, for each token bucket of
model_service/step/padded_step.py up to the largest step the scheduler sends (max_tokens: the
token budget the start-up profiled), largest first, all in one memory pool. A step of T token rows
replays the smallest bucket >= T, its inputs padded there (padded_step.py says why padding is
inert). The attention kernel reads every index from the device, its grid from the padded tile map,
so one capture serves any mix of decodes and chunks. A step that does not fit a bucket (prompt
logprobs over more rows than the bucket's sequences, a table wider than max_model_len's) runs
eagerly, as every step does where graphs are not used (`unsupported_reason`): off CUDA; with
cuda_graphs "off"; where attention runs the torch path (it sizes its gather from the step's
longest context on the host, which a graph would freeze); under tensor parallelism unless
cuda_graphs is "on" (below).

Under tensor parallelism each rank captures its own graphs, its collectives inside them (NCCL
records a collective in a graph since 2.9). NCCL asks that a captured collective be captured, and
its graph replayed, by every rank alike: here every rank builds the same buckets in the same order
at start, and each step's choice (its bucket, or eager) is a function of the plan that every rank
receives alike, so the ranks replay the same graph, or all run eagerly, step by step. The capture
is thread-local (`capture_mode`). "auto" leaves such steps eager: the capture under NCCL has not
run on several GPUs (CI checks the padded path under tensor parallelism on the CPU, with gloo and
cuda_graphs "eager"; a GPU test, collectives captured in a group of one); "on" captures them.

With LoRA on the Triton path (lora/triton_stack.py) each bucket has a second graph holding the
LoRA kernels, over the adapter stack's fixed slots and each row's slot in the padded step's
buffers: a step with adapter rows replays it, a step without replays the base graph, so base rows
pay no LoRA launches (a graph of the LoRA kernels on all slots -1 would launch ~15 empty kernels
a layer). Both sets share the one pool (they never replay at once). On the torch grouped path a
step with adapter rows runs eagerly (`run` returns None).

cuda_graphs "eager" runs the same bookkeeping (bucket, padding, static buffers) without capturing,
on any device: how CI checks it on the CPU, greedy tokens against the plain path.

Memory: the pool holds about one largest step's activations (logged at start as
step_graphs_captured); the KV budget leaves GRAPH_POOL_PEAKS profiled step peaks free for it
(model_service/step/kv_budget.py). Each graph copies its logits into one static output, so nothing
it allocated outlives its capture and the next (smaller) capture reuses the pool.

Numerics: a padded size runs the GEMMs at its own row count, and cuBLAS picks its kernels by shape,
so a row's logits may differ in the last bits from an eager step of T rows. cuBLAS is no more
batch invariant eagerly: on CUDA, batch invariance holds for the attention kernel only.
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol

import numpy as np
import structlog
import torch
import torch.distributed as dist

from model_service.attention import cuda_attention
from model_service.attention.kv_cache import KVCache
from model_service.attention.paged import cuda_path
from model_service.loading.loaded import LoadedModel
from model_service.step.padded_step import PaddedStep, token_buckets

log = structlog.get_logger(__name__)


class LoraKernels(Protocol):
    """The LoRA kernels' device stack (lora/triton_stack.py TritonStack), as the graphs use it:
    passed in by start-up, so that this room does not import the LoRA room (which reads plans)."""

    def hook(self, row_slot: torch.Tensor) -> Any: ...


def unsupported_reason(
    requested: str, device: torch.device, kv_cache: KVCache, tensor_parallel_size: int
) -> str | None:
    """Why steps run eagerly, or None where they are captured (`requested`: the config's
    cuda_graphs, "auto", "on", "eager" or "off"; "eager" is never refused: it captures nothing)."""
    if requested == "eager":
        return None
    if device.type != "cuda":
        return f"device {device.type}"
    if requested == "off":
        return "cuda_graphs=off"
    attention = cuda_path(kv_cache.k)
    if attention != "triton":
        return f"attention runs {attention}"
    if tensor_parallel_size > 1 and requested != "on":
        return "tensor parallel: not yet run on several GPUs; --cuda-graphs on captures them"
    return None


def records(
    requested: str, device: torch.device, kv_cache: KVCache, tensor_parallel_size: int
) -> bool:
    """Whether `capture` will record graphs (and so hold a pool the KV budget must leave free):
    supported, and not "eager", which pads without capturing."""
    reason = unsupported_reason(requested, device, kv_cache, tensor_parallel_size)
    return reason is None and requested != "eager"


def capture(
    requested: str,
    loaded: LoadedModel,
    kv_cache: KVCache,
    max_tokens: int,
    max_seqs: int,
    max_blocks_per_seq: int,
    lora_stack: LoraKernels | None = None,
) -> tuple[StepGraphs | None, str]:
    """The model's step graphs over `kv_cache` (captured now; with "eager", the padded path
    run without graphs) and the path Describe reports, or None and why. `lora_stack`: the
    adapters' device stack, whose kernels every graph then holds."""
    device = kv_cache.k.device
    reason = unsupported_reason(requested, device, kv_cache, loaded.tensor_parallel_size)
    if reason is not None:
        return None, f"none ({reason})"
    arch = loaded.arch
    step = PaddedStep(
        max_tokens,
        max_seqs,
        max_blocks_per_seq,
        kv_cache.block_size,
        cuda_attention.rows_per_tile(arch.num_attention_heads // arch.num_key_value_heads),
        device,
    )
    lora = "" if lora_stack is None else ", adapter rows included"
    if requested == "eager":
        graphs = StepGraphs(loaded.model, kv_cache, step, captured=False, lora_stack=lora_stack)
        count = len(graphs.sizes)
        return graphs, f"eager padded steps, {count} buckets up to {max_tokens} tokens{lora}"
    before = torch.cuda.memory_reserved(device)
    mode = capture_mode()
    try:
        graphs = StepGraphs(
            loaded.model, kv_cache, step, captured=True, lora_stack=lora_stack, capture_mode=mode
        )
    except RuntimeError as error:
        if loaded.tensor_parallel_size == 1:
            raise
        raise RuntimeError(
            f"cuda_graphs: capturing the steps under tensor parallelism failed ({error}); "
            "start with --cuda-graphs auto, which runs them eagerly"
        ) from error
    held = torch.cuda.memory_reserved(device) - before
    log.info("step_graphs_captured", sizes=len(graphs.sizes), bytes=held)
    lora += " (graphs of their own)" if lora else ""
    return graphs, f"every step, {len(graphs.sizes)} buckets up to {max_tokens} tokens{lora}"


def capture_mode() -> str:
    """torch.cuda.graph's capture_error_mode: "thread_local" where a process group is up (NCCL's
    watchdog thread queries its events while this thread captures, which a global capture
    refuses), else torch's default, "global"."""
    return "thread_local" if dist.is_available() and dist.is_initialized() else "global"


class StepGraphs:
    """The captured step of each token bucket over one PaddedStep's buffers (or, not captured,
    the same padded step run eagerly)."""

    def __init__(
        self,
        model,
        kv_cache: KVCache,
        step: PaddedStep,
        captured: bool,
        sizes=None,
        lora_stack: LoraKernels | None = None,
        capture_mode: str = "global",
    ) -> None:
        """`sizes`: the buckets (default: token_buckets up to the step's max_tokens; a bench
        captures only the one it times). `lora_stack`: the LoRA kernels' stack (module
        docstring), None where the graphs hold no adapters. `capture_mode`: torch.cuda.graph's
        capture_error_mode ("thread_local" under tensor parallelism: the module docstring)."""
        self.model, self.kv_cache, self.step = model, kv_cache, step
        self.lora_stack = lora_stack
        self.capture_mode = capture_mode
        self.sizes = sorted(sizes or token_buckets(step.max_tokens))
        self.captured = captured
        self.replays = 0  # steps served padded (tests, and the note's figures)
        # (bucket, with the LoRA kernels) -> its graph
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits = torch.empty(0)  # [max_seqs, vocab] once the first (largest) warm-up ran
        if captured:
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # largest first: the smaller reuse its memory
                self._capture(size, pool, adapters=False)
                if lora_stack is not None:
                    self._capture(size, pool, adapters=True)

    def _forward(self, size: int, eager_step=None, adapters: bool = False) -> torch.Tensor:
        """The model over a bucket's views; with `adapters` (and the LoRA stack), its kernels
        over the rows' slots; without, exactly the base path."""
        ids, positions, meta, logits_indices = self.step.args(size, eager_step)
        if self.lora_stack is None or not adapters:
            return self.model(ids, positions, meta, self.kv_cache, logits_indices)
        lora = self.lora_stack.hook(self.step.lora_slots(size))
        return self.model(ids, positions, meta, self.kv_cache, logits_indices, lora=lora)

    def _capture(self, size: int, pool, adapters: bool) -> None:
        self.step.clear()  # warm-up and capture run on all-padding inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            warm = self._forward(size, adapters=adapters)  # compiles and chooses, records nothing
        torch.cuda.current_stream().wait_stream(side)
        if self.logits.numel() == 0:
            self.logits = torch.empty((self.step.max_seqs, warm.shape[1]), dtype=warm.dtype,
                                      device=warm.device)  # fmt: skip
        del warm
        graph = torch.cuda.CUDAGraph()
        capturing = torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_mode)
        with torch.inference_mode(), capturing:
            self.logits[: self.step.seqs_of(size)].copy_(self._forward(size, adapters=adapters))
        self.graphs[(size, adapters)] = graph

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding num_tokens rows, or None past the largest."""
        index = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[index] if index < len(self.sizes) else None

    def run(
        self, x, num_scheduled: np.ndarray, logits_indices: np.ndarray, lora=None, taken=None
    ) -> torch.Tensor | None:
        """The step's logits [R, vocab] from its bucket, or None where it must run unpadded
        (`lora`, the step's adapter rows, on a path the graphs do not hold included), with
        nothing queued then. `taken`: input tokens from the device (PaddedStep.fill)."""
        if lora is not None and (
            self.lora_stack is None or getattr(lora, "stack", None) is not self.lora_stack
        ):
            return None  # adapter rows on a path the graphs do not hold
        size = self.bucket(int(x.num_tokens))
        if size is None or not self.step.fits(x, num_scheduled, logits_indices, size):
            return None
        slots = None if lora is None else lora.row_slot_host
        self.step.fill(x, num_scheduled, logits_indices, size, slots, taken)
        self.replays += 1
        count = logits_indices.size
        if not self.captured:
            return self._forward(size, x, adapters=lora is not None)[:count]
        self.graphs[(size, lora is not None)].replay()
        return self.logits[:count]
