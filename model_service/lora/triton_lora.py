"""The LoRA products of a step as grouped Triton kernels (CUDA), every adapter of the step in one
launch per factor, rows in any order:

    shrink  xa[t, :]          = x[t, :] @ A[s_t].T            A: [S, R, K]  (x: [T, K])
    expand  y[t, start + n]  += scale[s_t] * (xa[t, :] @ B[s_t].T)[n]   B: [S, N, R]

s_t = row_slot[t] is the row's place among the step's adapters (-1: a base-model row, which the
programs leave untouched); the adapters' factors are stacked in S slots padded with zeros to the
largest rank R (a zero column of A and row of B add nothing). xa stays float32 between the two;
the sum over K and over R runs in a fixed order inside one program per row (per row and column
block for the expand), and the block sizes come from K, R and N, never from T: a row computes
the same alone or among others (batch invariance by construction, as triton_ops' kernels).

The forward calls them on CUDA (lora/triton_stack.py: the device stack they read, the path's
decider, the layers' hook), eagerly and inside the captured steps; CI runs them under Triton's
interpreter (tests/model_service/test_ms_lora_triton*.py). The expand reads xa through its row
stride, so one shrink of a fused module (its targets' A side by side) feeds one expand per target.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel does not bring Triton
    triton = None

from model_service.kernels.triton_ops import COMPILE_OPTIONS

SHRINK_BLOCK_K = 128  # input columns per iteration of the shrink's loop
EXPAND_BLOCK_N = 64  # output columns per expand program


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def shrink(x: torch.Tensor, a: torch.Tensor, row_slot: torch.Tensor) -> torch.Tensor:
    """xa [T, R] float32: row t of x [T, K] times A[row_slot[t]].T (zeros where row_slot < 0)."""
    rows, k = x.shape
    slots, rank, k_a = a.shape
    if k_a != k or x.stride(1) != 1 or not a.is_contiguous() or row_slot.shape != (rows,):
        raise ValueError(
            f"shrink: x {tuple(x.shape)}, A {tuple(a.shape)}, row_slot {tuple(row_slot.shape)}"
        )
    out = torch.zeros((rows, rank), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    _shrink_kernel[(rows,)](
        x, a, row_slot, out, x.stride(0), k, rank,
        BLOCK_K=min(SHRINK_BLOCK_K, _pow2(k)), BLOCK_R=_pow2(rank), **COMPILE_OPTIONS,
    )  # fmt: skip
    return out


def expand_(
    y: torch.Tensor,
    xa: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    row_slot: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """y[t, start:start + N] += scale[s] * xa[t] @ B[s].T for s = row_slot[t] >= 0, in place
    (the sum in float32, rounded once to y's dtype as it is added); returns y. xa may be a
    column slice of a wider shrink output (its rows strided)."""
    rows, rank = xa.shape
    slots, n, rank_b = b.shape
    if (
        rank_b != rank
        or y.stride(1) != 1
        or xa.stride(1) != 1
        or start + n > y.shape[1]
        or not b.is_contiguous()
    ):
        raise ValueError(
            f"expand: y {tuple(y.shape)} at {start}, xa {tuple(xa.shape)}, B {tuple(b.shape)}"
        )
    if rows == 0:
        return y
    block_n = min(EXPAND_BLOCK_N, _pow2(n))
    _expand_kernel[(rows, triton.cdiv(n, block_n))](
        y, xa, b, scale, row_slot, y.stride(0), xa.stride(0), start, n, rank,
        BLOCK_N=block_n, BLOCK_R=_pow2(rank), **COMPILE_OPTIONS,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def _shrink_kernel(
        x, a, row_slot, out, x_stride, K, R, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr
    ):
        row = tl.program_id(0)
        slot = tl.load(row_slot + row)
        if slot >= 0:
            r = tl.arange(0, BLOCK_R)
            acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
            a_slot = a + slot.to(tl.int64) * R * K
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(x + row.to(tl.int64) * x_stride + k, mask=k < K, other=0.0).to(
                    tl.float32
                )
                w = tl.load(
                    a_slot + r[:, None] * K + k[None, :],
                    mask=(r[:, None] < R) & (k[None, :] < K),
                    other=0.0,
                )
                acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
            tl.store(out + row.to(tl.int64) * R + r, acc, mask=r < R)

    @triton.jit
    def _expand_kernel(
        y,
        xa,
        b,
        scale,
        row_slot,
        y_stride,
        xa_stride,
        start,
        N,
        R,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        row = tl.program_id(0)
        slot = tl.load(row_slot + row)
        if slot >= 0:
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            r = tl.arange(0, BLOCK_R)
            v = tl.load(xa + row.to(tl.int64) * xa_stride + r, mask=r < R, other=0.0)
            w = tl.load(
                b + slot.to(tl.int64) * N * R + n[:, None] * R + r[None, :],
                mask=(n[:, None] < N) & (r[None, :] < R),
                other=0.0,
            )
            delta = tl.sum(w.to(tl.float32) * v[None, :], axis=1) * tl.load(scale + slot)
            at = y + row.to(tl.int64) * y_stride + start + n
            current = tl.load(at, mask=n < N, other=0.0)
            tl.store(at, (current.to(tl.float32) + delta).to(current.dtype), mask=n < N)
