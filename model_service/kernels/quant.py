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

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ w.T (+ bias), in out_dtype (default x's)."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if exact_blocks(x):
            # Where the native GEMM does not run (its path is torch's, or the CPU lacks it), the
            # same arithmetic in torch: bf16 through a dequantized weight rounds the weight and
            # loses the int8 model's quality (x's int16 is finer than bf16's 8 bits).
            out = int8_block_linear(x.reshape(-1, x.shape[-1]), self.w)
            out = out.view(*x.shape[:-1], out.shape[-1])  # -1 is ambiguous at zero rows
            out = out if bias is None else out + bias.float()
        else:
            out = F.linear(x, self.w.dequantize(x.dtype), bias)
        return out.to(out_dtype or x.dtype)


def exact_blocks(x: torch.Tensor) -> bool:
    """Whether an Int8Linear computes x as the native kernel does (int8_block_linear): bfloat16
    on the CPU, the native kernel's own case; float32 and other devices dequantize."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu"


# Rows of x per pass of int8_block_linear: its [blocks, rows, N] partial dots stay bounded.
_ROWS_PER_PASS = 64


def int8_block_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [R, K] (bfloat16) times the int8 weight, float32 [R, N], computed as the native kernel
    computes it (cython_ext/csrc/gemm.h): each row of x quantized per block of 32 to int16
    (d_x = max|x| / 32767, q = x * (32767 / max|x|) rounded to nearest even, in float32), each
    block's dot product exact, out = the blocks' dots times d_x * d_w added in block order.

    The exact dots come from float32 matmuls over q's high and low bytes (q = 256 hi + lo): every
    partial sum is an integer below 2^24, so whatever order the matmul adds in, the integers are
    exact, and a row's result depends on nothing but the row (batch-invariant)."""
    rows, k = x.shape
    blocks = k // BLOCK
    q_w = w.qweight.view(-1, blocks, BLOCK).permute(1, 2, 0).to(torch.float32)  # [B, 32, N]
    d_w = w.scale.to(torch.float32).t()  # [B, N]
    out = torch.empty((rows, q_w.shape[2]), dtype=torch.float32, device=x.device)
    for first in range(0, rows, _ROWS_PER_PASS):
        part = slice(first, min(rows, first + _ROWS_PER_PASS))
        out[part] = _int8_rows(x[part].to(torch.float32).view(-1, blocks, BLOCK), q_w, d_w)
    return out


def _int8_rows(x: torch.Tensor, q_w: torch.Tensor, d_w: torch.Tensor) -> torch.Tensor:
    """x [r, B, 32] float32 -> [r, N] float32 (int8_block_linear's arithmetic)."""
    amax = x.abs().amax(dim=2)  # [r, B]
    d_x = amax / 32767.0
    # tensor / tensor: an IEEE division, as the kernel's (127.0 / t would be 127 * (1 / t))
    inverse = torch.where(amax > 0, torch.full_like(amax, 32767.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inverse[..., None]).transpose(0, 1)  # [B, r, 32], integers <= 32767
    high = torch.floor(q / 256.0)
    low = q - high * 256.0  # in [0, 255]
    dots = torch.bmm(high, q_w).double() * 256.0 + torch.bmm(low, q_w).double()  # [B, r, N]
    dots = dots.to(torch.float32)  # as the kernel converts its int32 dot
    out = torch.zeros(dots.shape[1:], dtype=torch.float64, device=x.device)
    for block in range(dots.shape[0]):
        scale = d_x[:, block, None] * d_w[None, block]  # float32, as the kernel's
        # fma(dot, scale, out): the float32 product is exact in float64, one rounding after
        out = (dots[block].double() * scale.double() + out).to(torch.float32).double()
    return out.to(torch.float32)


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
