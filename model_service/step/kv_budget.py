"""How many KV blocks to allocate: as configured, or as many as a memory budget holds (a byte
count, or a fraction of the device's free memory after the weights are loaded). The one owner of
the budget's rules:

    given                        budget
    num_kv_blocks                that many blocks (checked to fit beside the step, on CUDA)
    gpu_memory_utilization       CUDA: share x the GPU's total, less what this service's tensors
                                 hold (weights, adapters, a draft), the step's peak, the graphs
                                 and a reserve (vLLM's flag and meaning; it must fit the free)
    kv_cache_memory_fraction     fraction x free, less the step's peak, the graphs and a reserve
    kv_cache_memory_bytes        that many bytes (checked to fit beside the step, on CUDA)
    none, CUDA                   as a fraction of CUDA_KV_CACHE_MEMORY_FRACTION (vLLM's
                                 gpu_memory_utilization default)
    none, CPU                    CPU_KV_CACHE_BYTES

On CUDA the runner first measures the activation memory of the largest step
(model_service/step/profile_step.py). CUDA graphs captured after the cache is allocated hold
their own memory pool, about one largest step's activations: when they will be captured, the
budget leaves one more step peak free for them (graphs_reserve_bytes). A cache sized by a byte
count or a block count that leaves less than the peak, the graphs and the reserve free refuses to
start (naming the field), instead of running out of memory at the first long prefill. On the CPU
there is no profile: the host's MemAvailable is the base of a fraction, and a step's activations
are small beside it.

Tensor-parallel ranks each cache their own KV heads and measure their own free memory; with a
fraction they agree on the smallest count, so every block id the scheduler hands out exists on
every rank.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch

from model_service.attention.kv_cache import kv_block_bytes
from model_service.config import ModelServiceConfig
from model_service.loading.loaded import LoadedModel
from model_service.step import step_shape

# CUDA memory the KV budget leaves free beside the profiled step's peak: what the caching
# allocator does not count (the CUDA context's growth as kernels load, NCCL's buffers under tensor
# parallelism) and its fragmentation.
CUDA_RESERVE_BYTES = 256 << 20
# The KV budget when no flag sizes it. On CUDA the cache is what the service is for: it takes
# most of the device, the rest is headroom for what the profile cannot see.
CUDA_KV_CACHE_MEMORY_FRACTION = 0.9
CPU_KV_CACHE_BYTES = 1 << 30


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of `device` now: CUDA's free bytes, or the host's MemAvailable (what the
    kernel can hand out without swapping; falls back to free pages where /proc is missing)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_usage(device: torch.device) -> tuple[int, int]:
    """A CUDA device's total memory and what this process's tensors hold on it now (torch's
    allocator: the weights, the adapters' stack, a draft model; not the CUDA context, which the
    reserve stands for)."""
    return step_shape.total_memory_bytes(device), int(torch.cuda.memory_allocated(device))


# The graphs' pool in profiled step peaks. Beyond the largest step's activations it holds the
# static logits and inputs, the side stream's cuBLAS workspace and what each of the buckets'
# captures keeps; measured on an H200 at 1.1-2.2 peaks (docs/benchmarks.md, "Every step
# captured"), so one peak undercounted it.
GRAPH_POOL_PEAKS = 2


def graphs_reserve_bytes(step_peak_bytes: Optional[int], graphs_captured: bool) -> int:
    """Memory the CUDA graphs' shared pool takes after the cache is allocated: the graphs capture
    steps up to the token budget (0 when no graphs are captured or no step was profiled)."""
    if not graphs_captured or step_peak_bytes is None:
        return 0
    return GRAPH_POOL_PEAKS * step_peak_bytes


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """The KV cache's budget and what it was made of."""

    bytes: int
    field: str
    """The config field that sized it (named when it is too small), "(default)" marked."""
    fraction: Optional[float] = None
    """A fraction of free_bytes (of total_bytes with gpu_memory_utilization); None for a byte
    count."""
    free_bytes: int = 0
    step_peak_bytes: int = 0
    graphs_bytes: int = 0
    reserve_bytes: int = 0
    total_bytes: int = 0
    """gpu_memory_utilization: the GPU's total memory, and what this service held already."""
    in_use_bytes: int = 0

    def basis(self) -> str:
        """One line for the log and Describe's compute map."""
        if self.fraction is None:
            return f"{self.bytes} bytes ({self.field})"
        if self.total_bytes:
            return (
                f"share {self.fraction:g} of {self.total_bytes} total, less {self.in_use_bytes} "
                f"in use, step peak {self.step_peak_bytes}, graphs {self.graphs_bytes}, reserve "
                f"{self.reserve_bytes}: {self.bytes} ({self.field})"
            )
        return (
            f"fraction {self.fraction:g} of {self.free_bytes} free after weights, step peak "
            f"{self.step_peak_bytes}, graphs {self.graphs_bytes}, reserve {self.reserve_bytes}: "
            f"{self.bytes} ({self.field})"
        )


def kv_budget(
    config: ModelServiceConfig,
    device_type: str,
    free_bytes: Callable[[], int],
    num_ranks: int = 1,
    step_peak_bytes: Optional[int] = None,
    graphs_bytes: int = 0,
    usage: Optional[Callable[[], tuple[int, int]]] = None,
) -> KVBudget:
    """The KV budget by the table in the module docstring. free_bytes: the device's free memory
    now (read only for a fraction; tests pin it). step_peak_bytes (CUDA: the profiled step's
    peak; None where none ran) and graphs_bytes are left free beside CUDA_RESERVE_BYTES when the
    budget is a fraction; with a byte count the caller checks that they fit (check_fits).
    usage: the device's (total, in use by this service) for gpu_memory_utilization."""
    if config.gpu_memory_utilization is not None:
        if device_type != "cuda" or usage is None:
            raise ValueError(
                f"gpu_memory_utilization: a share of a GPU's memory, and this model service runs "
                f"on the {device_type}: size its KV cache with --kv-cache-memory or "
                "--kv-cache-memory-fraction"
            )
        return share_of_device(
            config.gpu_memory_utilization, usage(), free_bytes(), step_peak_bytes or 0, graphs_bytes
        )
    fraction = config.kv_cache_memory_fraction
    field = "kv_cache_memory_fraction"
    if fraction is None and config.kv_cache_memory_bytes is not None:
        return KVBudget(config.kv_cache_memory_bytes, "kv_cache_memory_bytes")
    if fraction is None and device_type != "cuda":
        return KVBudget(CPU_KV_CACHE_BYTES, "kv_cache_memory_bytes (default)")
    if fraction is None:
        fraction, field = CUDA_KV_CACHE_MEMORY_FRACTION, "kv_cache_memory_fraction (default)"
    free = free_bytes()
    if device_type != "cuda":
        free //= num_ranks  # tensor-parallel ranks on the CPU share the host's memory
    budget = int(free * fraction)
    reserve = 0
    if step_peak_bytes is not None:
        reserve = CUDA_RESERVE_BYTES
        budget = max(0, budget - step_peak_bytes - graphs_bytes - reserve)
    return KVBudget(budget, field, fraction, free, step_peak_bytes or 0, graphs_bytes, reserve)


def share_of_device(
    share: float, usage: tuple[int, int], free: int, step_peak_bytes: int, graphs_bytes: int
) -> KVBudget:
    """gpu_memory_utilization's budget: `share` of the device's total, less what this service
    holds (usage: total, in use), the largest step's peak, the graphs' pool and the reserve.
    ValueError naming the field where that is more than the free memory: another process holds
    the rest (vLLM refuses to start there too)."""
    total, in_use = usage
    aside = step_peak_bytes + graphs_bytes + CUDA_RESERVE_BYTES
    budget = max(0, int(total * share) - in_use - aside)
    if budget + aside > free:
        raise ValueError(
            f"gpu_memory_utilization: {share:g} of the GPU's {total} bytes leaves {budget} for "
            f"the KV cache beside the {in_use} this service holds and {aside} for the largest "
            f"step, the graphs and a reserve, but {free} are free (other processes hold the "
            "rest): lower gpu_memory_utilization"
        )
    return KVBudget(
        budget, "gpu_memory_utilization", share, free, step_peak_bytes, graphs_bytes,
        CUDA_RESERVE_BYTES, total, in_use,
    )  # fmt: skip


def agree_on_num_blocks(num_blocks: int, device: torch.device) -> int:
    """Tensor-parallel ranks each measured their free memory: all take the smallest count, so that
    every block id the scheduler hands out exists on every rank. A collective over the default
    group: every rank calls it at the same point (building its runner)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return num_blocks
    count = torch.tensor(
        [num_blocks], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu"
    )
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())


@dataclasses.dataclass(frozen=True)
class KVSizing:
    """The block count to allocate and the budget it came from (None: a fixed block count)."""

    num_blocks: int
    budget: Optional[KVBudget] = None

    def basis(self) -> str:
        return f"{self.num_blocks} blocks (fixed)" if self.budget is None else self.budget.basis()


def size_kv_cache(
    config: ModelServiceConfig,
    loaded: LoadedModel,
    dtype: torch.dtype,
    device: torch.device,
    step_peak_bytes: int | None = None,
    draft_block_bytes: int = 0,
    graphs_bytes: int = 0,
    free_bytes: Optional[Callable[[torch.device], int]] = None,
    usage: Optional[Callable[[torch.device], tuple[int, int]]] = None,
) -> KVSizing:
    """The blocks to allocate: num_kv_blocks as configured (or as the model fixes it), else as
    many as the memory budget holds (ValueError naming the budget's field below 2).
    step_peak_bytes (CUDA: the profiled step's peak) and graphs_bytes (graphs_reserve_bytes) are
    left free beside CUDA_RESERVE_BYTES. draft_block_bytes: a draft model's KV per block
    (draft_model.py), which keeps its own cache of the same block count: the budget holds both
    caches. free_bytes: the device's free memory (available_memory_bytes unless a test pins it);
    usage: its total and what this service holds (device_usage, likewise)."""
    arch = loaded.arch
    # Under tensor parallelism each rank caches only its own KV heads.
    per_block = draft_block_bytes + kv_block_bytes(
        arch.num_hidden_layers,
        config.block_size,
        loaded.num_kv_heads_per_rank,
        arch.head_dim,
        dtype,
    )
    free = free_bytes or available_memory_bytes  # looked up now: tests pin the module's
    fixed = config.num_kv_blocks if config.num_kv_blocks is not None else loaded.num_kv_blocks
    if fixed is not None:
        if step_peak_bytes is not None:
            check_fits(
                "num_kv_blocks", fixed * per_block, step_peak_bytes + graphs_bytes, free(device)
            )
        return KVSizing(fixed)
    budget = kv_budget(
        config, device.type, lambda: free(device), loaded.tensor_parallel_size, step_peak_bytes,
        graphs_bytes, lambda: (usage or device_usage)(device),
    )  # fmt: skip
    if budget.fraction is None and step_peak_bytes is not None:
        check_fits(budget.field, budget.bytes, step_peak_bytes + graphs_bytes, free(device))
    num_blocks = budget.bytes // per_block
    if budget.fraction is not None and loaded.tensor_parallel_size > 1:
        num_blocks = agree_on_num_blocks(num_blocks, device)  # free memory differs per rank
    if num_blocks < 2:
        left = (
            ""
            if step_peak_bytes is None
            else f" (after the largest step's {step_peak_bytes} bytes, the graphs' "
            f"{graphs_bytes} and a reserve of {CUDA_RESERVE_BYTES}: lower profile_step_tokens "
            "or max_num_slots)"
        )
        raise ValueError(
            f"{budget.field}: a budget of {budget.bytes} bytes{left} holds {num_blocks} blocks of "
            f"{per_block} bytes; need >= 2"
        )
    return KVSizing(num_blocks, budget)


def check_fits(field: str, cache_bytes: int, step_bytes: int, free: int) -> None:
    """A KV cache of cache_bytes must leave step_bytes (the largest step's peak and the graphs')
    and the reserve free, of `free` bytes (ValueError naming the field that sized the cache)."""
    needed = cache_bytes + step_bytes + CUDA_RESERVE_BYTES
    if needed > free:
        raise ValueError(
            f"{field}: a KV cache of {cache_bytes} bytes, the largest step's and the graphs' "
            f"{step_bytes} bytes and a reserve of {CUDA_RESERVE_BYTES} need {needed} bytes; "
            f"{free} are free (lower {field} or profile_step_tokens)"
        )
