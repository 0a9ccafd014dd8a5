"""The paged KV cache: preallocated once, addressed by block id.

One K and one V tensor of shape [num_layers, num_blocks, kv_heads, block_size, head_dim]; layer l
uses the views k[l], v[l]. Within a block each KV head's positions are contiguous, so the attention
kernel reads a block of one head as one [block_size, head_dim] tile (model_service/attention.py).
Block 0 is reserved: the scheduler never hands it out, and padded block-table entries point to it,
so it must stay finite (it is zero-filled and never written).

Swap space: the same shape again with num_swap_blocks in host memory (pinned on CUDA, so copies
overlap nothing but need no staging). Swap ids are [0, num_swap_blocks), none reserved: they
never appear in a block table.

The block operations of one plan run in this order, before the forward:

    swap_out   device -> host   reads blocks the scheduler freed in this plan's preemptions
    copy       device -> device copy-on-write; its source may also be a block freed just now
    swap_in    host -> device   writes blocks freshly allocated in this plan

Fresh blocks (copy and swap-in destinations) may be blocks freed in the same plan, so every read
of a freed block comes before any write of a fresh one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model_service.config import ModelServiceConfig
    from model_service.loaded import LoadedModel


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        # zeros, not empty: masked attention weights are exactly 0, and 0 * NaN garbage is NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = kv_block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)

        self.num_swap_blocks = 0
        self.host_k: torch.Tensor | None = None
        self.host_v: torch.Tensor | None = None

    def allocate_swap(self, num_swap_blocks: int) -> None:
        """Host tensors for num_swap_blocks swapped-out blocks (pinned when the cache is on
        CUDA)."""
        if num_swap_blocks <= 0:
            return
        shape = (self.k.shape[0], num_swap_blocks, *self.k.shape[2:])
        pin = self.k.device.type == "cuda"
        self.host_k = torch.zeros(shape, dtype=self.k.dtype, device="cpu", pin_memory=pin)
        self.host_v = torch.zeros(shape, dtype=self.k.dtype, device="cpu", pin_memory=pin)
        self.num_swap_blocks = num_swap_blocks

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks src[i] -> dst[i] in every layer (copy-on-write of a shared block)."""
        if src.numel() == 0:
            return
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def swap_out(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Device blocks src[i] -> host swap blocks dst[i], every layer (src on the cache's device,
        dst on the CPU)."""
        if src.numel() == 0:
            return
        # index_select + index_copy_: a gather and a scatter of whole blocks, several times
        # faster on the CPU than advanced-index assignment (k[:, dst] = ...).
        self.host_k.index_copy_(1, dst, self.k.index_select(1, src).to("cpu"))
        self.host_v.index_copy_(1, dst, self.v.index_select(1, src).to("cpu"))

    def swap_in(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Host swap blocks src[i] -> device blocks dst[i], every layer (src on the CPU, dst on
        the cache's device)."""
        if src.numel() == 0:
            return
        device = self.k.device
        self.k.index_copy_(1, dst, self.host_k.index_select(1, src).to(device))
        self.v.index_copy_(1, dst, self.host_v.index_select(1, src).to(device))


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
    config: ModelServiceConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device
) -> int:
    """The blocks to allocate: num_kv_blocks as configured (or as the model fixes it), else as
    many as the memory budget holds (ValueError naming the budget's field below 2)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if loaded.num_kv_blocks is not None:
        return loaded.num_kv_blocks
    arch = loaded.arch
    # Under tensor parallelism each rank caches only its own KV heads.
    per_block = kv_block_bytes(
        arch.num_hidden_layers,
        config.block_size,
        loaded.num_kv_heads_per_rank,
        arch.head_dim,
        dtype,
    )
    budget = kv_cache_budget_bytes(
        config.kv_cache_memory_bytes,
        config.kv_cache_memory_fraction,
        device,
        loaded.tensor_parallel_size,
    )
    num_blocks = budget // per_block
    if config.kv_cache_memory_fraction is not None and loaded.tensor_parallel_size > 1:
        num_blocks = agree_on_num_blocks(num_blocks, device)  # free memory differs per rank
    if num_blocks < 2:
        field = (
            "kv_cache_memory_bytes"
            if config.kv_cache_memory_fraction is None
            else "kv_cache_memory_fraction"
        )
        raise ValueError(
            f"{field}: a budget of {budget} bytes holds {num_blocks} blocks of {per_block} "
            "bytes; need >= 2"
        )
    return num_blocks
