"""The paged KV cache: preallocated once, addressed by block id.

One K and one V tensor of shape [num_layers, num_blocks, block_size, kv_heads, head_dim]; layer l
uses the views k[l], v[l]. Block 0 is reserved: the scheduler never hands it out, and padded
block-table entries point to it, so it must stay finite (it is zero-filled and never written).
"""

from __future__ import annotations

import torch


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
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
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: masked attention weights are exactly 0, and 0 * NaN garbage is NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks src[i] -> dst[i] in every layer (copy-on-write of a shared block)."""
        if src.numel() == 0:
            return
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
