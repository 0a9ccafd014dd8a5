"""The paged KV cache: preallocated once, addressed by block id.

One K and one V tensor of shape [num_layers, num_blocks, kv_heads, block_size, head_dim]; layer l
uses the views k[l], v[l]. Within a block each KV head's positions are contiguous, so the attention
kernel reads a block of one head as one [block_size, head_dim] tile
(model_service/attention/paged.py). Block 0 is reserved: the scheduler never hands it out, and
padded block-table entries point to it, so it must stay finite (it is zero-filled and never
written).

Swap space: num_swap_blocks blocks in host memory, block-major ([num_swap_blocks, num_layers,
kv_heads, block_size, head_dim]: a block's K, or V, is one contiguous range). Swap ids are [0,
num_swap_blocks), none reserved: they never appear in a block table. On CUDA it is pinned and a swap
is queued on the current stream like a step: the blocks are gathered (or scattered) on the device
and each run of consecutive swap ids moves in one copy (asynchronous on CUDA; the CPU runs the same
code, synchronously). The host never reads the swap space itself, so nothing waits: stream order
puts a swap-out after the steps queued before it (a step launched ahead may still be writing the
blocks it reads), and a swap-in of those blocks after it (model_service/step/launch_ahead.py).

The block operations of one plan run in this order, before the forward:

    swap_out   device -> host   reads blocks the scheduler freed in this plan's preemptions
    copy       device -> device copy-on-write; its source may also be a block freed just now
    swap_in    host -> device   writes blocks freshly allocated in this plan

Fresh blocks (copy and swap-in destinations) may be blocks freed in the same plan, so every read
of a freed block comes before any write of a fresh one.
"""

from __future__ import annotations

import torch


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
        # No swap space until allocate_swap: host tensors of 0 blocks.
        self.host_k = torch.zeros((0, num_layers, *shape[2:]), dtype=dtype)
        self.host_v = torch.zeros_like(self.host_k)

    def allocate_swap(self, num_swap_blocks: int) -> None:
        """Host tensors for num_swap_blocks swapped-out blocks, block-major (pinned when the cache
        is on CUDA)."""
        if num_swap_blocks <= 0:
            return
        shape = (num_swap_blocks, self.k.shape[0], *self.k.shape[2:])
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
        runs = _runs(dst)
        for cache, host in ((self.k, self.host_k), (self.v, self.host_v)):
            # One gather of whole blocks on the device, block-major as the host holds them
            # (index_select: several times faster on the CPU than advanced indexing).
            blocks = cache.transpose(0, 1).index_select(0, src)
            for first, at, count in runs:
                host[first : first + count].copy_(blocks[at : at + count], non_blocking=True)

    def swap_in(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Host swap blocks src[i] -> device blocks dst[i], every layer (src on the CPU, dst on
        the cache's device)."""
        if src.numel() == 0:
            return
        runs = _runs(src)
        for cache, host in ((self.k, self.host_k), (self.v, self.host_v)):
            blocks = torch.empty((src.numel(), *host.shape[1:]), dtype=host.dtype,
                                 device=cache.device)  # fmt: skip
            for first, at, count in runs:
                blocks[at : at + count].copy_(host[first : first + count], non_blocking=True)
            cache.index_copy_(1, dst, blocks.transpose(0, 1))


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first id, its index in ids, length) of each run of consecutive ids, in order: each run
    moves in one copy."""
    runs: list[tuple[int, int, int]] = []
    for index, value in enumerate(ids.tolist()):
        if runs and value == runs[-1][0] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((value, index, 1))
    return runs
