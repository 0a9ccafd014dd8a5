"""Int8 weight-only quantization, applied at load time (`--quantization int8`,
model_service/loading/build.py
quantizes each linear layer as it reads it).

Every `nn.Linear` and the token embedding keep their weight as int8 in Q8_0-like blocks: 32
consecutive input columns of one output row share one scale, symmetric, `w ~= q * scale`,
`scale = max|block| / 127`. When the embedding is tied to lm_head, both modules share the one int8
matrix, so the quantized model holds ~1.06 bytes per parameter (float16 scales).
Activations, norms, the KV cache and the logits keep the compute dtype.

Why blocks and not one scale per output channel: per-channel int8 (even with an MSE-chosen clip)
flipped SmolLM2's greedy token at step 1 of the haiku chat prompt (reference top-2 gap 0.12) and at
step 10 of the text prompt (gap 0.05); blocks of 32 kept all 16 tokens of the 3 test prompts.
That rules out `aten._weight_int8pack_mm`, which takes per-channel scales only (it was ~3x faster
than a dense bf16 matmul at 1 row, and slower than dequantize + matmul above ~16 rows). In bf16
on a CPU with AVX512-BF16/VNNI, model_service/kernels/gemm.py packs these blocks for its native
kernel (x quantized to int16 per block, integer block dot products: no dequantized weight is ever
made); elsewhere the forward dequantizes each weight into the compute dtype per call and runs
the dense kernel (see bench/results/forward.json).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("none", "int8")
BLOCK = 32


def quantize_blocks(
    weight: torch.Tensor, block: int = BLOCK, rows_per_chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and float32 scales [N, K // block] with weight ~= q * scale per block of columns.
    Computed in float32 from the weight's values, rows_per_chunk rows at a time, so a large matrix
    (a 128k-vocab lm_head) needs float32 room for one chunk, not for all of it."""
    n, k = weight.shape
    if k % block:
        raise ValueError(
            f"quantization: input size {k} is not a multiple of the block size {block}"
        )
    q = torch.empty((n, k), dtype=torch.int8, device=weight.device)
    scale = torch.empty((n, k // block), dtype=torch.float32, device=weight.device)
    for first in range(0, n, rows_per_chunk):
        rows = slice(first, min(n, first + rows_per_chunk))
        w = weight[rows].detach().to(torch.float32).view(-1, k // block, block)
        scale[rows] = (w.abs().amax(dim=2) / 127.0).clamp(min=1e-12)
        q[rows] = torch.round(w / scale[rows, :, None]).clamp(-127, 127).to(torch.int8).view(-1, k)
    return q, scale


class Int8Weight(nn.Module):
    """The int8 matrix and its block scales; shared by the tied embedding and lm_head."""

    qweight: torch.Tensor  # buffers, declared for the type checker
    scale: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """From a weight, or from its quantize_blocks output (the loader quantizes by chunks)."""
        super().__init__()
        q, scale = quantized if quantized is not None else quantize_blocks(weight)
        self.register_buffer("qweight", q)
        self.register_buffer(
            "scale", scale.to(torch.float16)
        )  # float16 like Q8_0, whatever the compute dtype
        # Zero-size, cast with the model: it carries the compute dtype for the embedding's output.
        self.register_buffer("like", torch.empty(0, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # model.to(dtype) would round the float16 scales through the compute dtype: move them only.
        scale = self.scale
        super()._apply(fn, recurse)
        self.scale = scale.to(self.qweight.device)
        return self

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] (or the chosen rows) in dtype."""
        q, scale = (
            (self.qweight, self.scale) if rows is None else (self.qweight[rows], self.scale[rows])
        )
        blocks = q.view(*q.shape[:-1], scale.shape[-1], -1).to(dtype) * scale.to(dtype)[..., None]
        return blocks.view(q.shape)


class Int8Linear(nn.Module):
    w: Int8Weight

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.w = weight
        self.register_buffer("bias", bias)  # in the compute dtype, like any bias (Qwen2's q/k/v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(
            x, self.w.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )


class Int8Embedding(nn.Module):
    def __init__(self, weight: Int8Weight) -> None:
        super().__init__()
        self.w = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.dequantize(self.w.like.dtype, rows=ids)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (a tied weight counted once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total
