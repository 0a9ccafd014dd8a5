"""How many KV blocks to allocate: as configured, or as many as a memory budget holds (a byte
count, or a fraction of the device's free memory after the weights are loaded).

On CUDA the runner first measures the activation memory of the largest step
(model_service/step/profile_step.py). With a fraction, the KV cache gets that fraction of the free
memory less the step's peak and CUDA_RESERVE_BYTES; with a byte count or a block count, a cache
that leaves less than the peak and the reserve free refuses to start (naming the field), instead
of running out of memory at the first long prefill. On the CPU there is no profile: the host's
MemAvailable is the budget's base, and a step's activations are small beside it.

Tensor-parallel ranks each cache their own KV heads and measure their own free memory; with a
fraction they agree on the smallest count, so every block id the scheduler hands out exists on
every rank.
"""

from __future__ import annotations

import os

import torch

from model_service.attention.kv_cache import kv_block_bytes
from model_service.config import ModelServiceConfig
from model_service.loading.loaded import LoadedModel

# CUDA memory the KV budget leaves free beside the profiled step's peak: what the caching
# allocator does not count (the CUDA context's growth as kernels load, NCCL's buffers under tensor
# parallelism) and its fragmentation.
CUDA_RESERVE_BYTES = 256 << 20


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


def kv_cache_budget_bytes(
    memory_bytes: int, memory_fraction: float | None, device: torch.device, num_ranks: int = 1
) -> int:
    """The KV budget: memory_fraction of the device's free memory when set, else memory_bytes.
    Tensor-parallel ranks on the CPU share the host's memory: each takes 1/num_ranks of it."""
    if memory_fraction is None:
        return memory_bytes
    free = available_memory_bytes(device)
    if device.type != "cuda":
        free //= num_ranks
    return int(free * memory_fraction)


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


def count_kv_blocks(
    config: ModelServiceConfig,
    loaded: LoadedModel,
    dtype: torch.dtype,
    device: torch.device,
    step_peak_bytes: int | None = None,
    draft_block_bytes: int = 0,
) -> int:
    """The blocks to allocate: num_kv_blocks as configured (or as the model fixes it), else as
    many as the memory budget holds (ValueError naming the budget's field below 2).
    step_peak_bytes (CUDA: the profiled step's peak) is left free beside CUDA_RESERVE_BYTES.
    draft_block_bytes: a draft model's KV per block (draft_model.py), which keeps its own cache
    of the same block count: the budget holds both caches."""
    arch = loaded.arch
    # Under tensor parallelism each rank caches only its own KV heads.
    per_block = draft_block_bytes + kv_block_bytes(
        arch.num_hidden_layers,
        config.block_size,
        loaded.num_kv_heads_per_rank,
        arch.head_dim,
        dtype,
    )
    fixed = config.num_kv_blocks if config.num_kv_blocks is not None else loaded.num_kv_blocks
    if fixed is not None:
        if step_peak_bytes is not None:
            check_fits("num_kv_blocks", fixed * per_block, step_peak_bytes, device)
        return fixed
    budget = kv_cache_budget_bytes(
        config.kv_cache_memory_bytes,
        config.kv_cache_memory_fraction,
        device,
        loaded.tensor_parallel_size,
    )
    field = (
        "kv_cache_memory_bytes"
        if config.kv_cache_memory_fraction is None
        else "kv_cache_memory_fraction"
    )
    if step_peak_bytes is not None:
        if config.kv_cache_memory_fraction is None:
            check_fits(field, budget, step_peak_bytes, device)
        else:
            budget = max(0, budget - step_peak_bytes - CUDA_RESERVE_BYTES)
    num_blocks = budget // per_block
    if config.kv_cache_memory_fraction is not None and loaded.tensor_parallel_size > 1:
        num_blocks = agree_on_num_blocks(num_blocks, device)  # free memory differs per rank
    if num_blocks < 2:
        left = (
            ""
            if step_peak_bytes is None
            else f" (after the largest step's {step_peak_bytes} bytes and a reserve of "
            f"{CUDA_RESERVE_BYTES}: lower profile_step_tokens or max_num_slots)"
        )
        raise ValueError(
            f"{field}: a budget of {budget} bytes{left} holds {num_blocks} blocks of {per_block} "
            "bytes; need >= 2"
        )
    return num_blocks


def check_fits(field: str, cache_bytes: int, step_peak_bytes: int, device: torch.device) -> None:
    """A KV cache of cache_bytes must leave the largest step's peak and the reserve free on
    `device` (ValueError naming the field that sized the cache)."""
    free = available_memory_bytes(device)
    needed = cache_bytes + step_peak_bytes + CUDA_RESERVE_BYTES
    if needed > free:
        raise ValueError(
            f"{field}: a KV cache of {cache_bytes} bytes, the largest step's {step_peak_bytes} "
            f"bytes and a reserve of {CUDA_RESERVE_BYTES} need {needed} bytes; {device} has "
            f"{free} free (lower {field} or profile_step_tokens)"
        )
