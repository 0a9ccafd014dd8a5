"""The decoder's row-wise operations on CUDA as fused Triton kernels: residual add + RMSNorm, RoPE
in place, SiLU x up. model_service/kernels/layer_ops.py decides where they run (CUDA, Triton
present, layer_ops_isa not "torch") and keeps the torch path beside them for A/B checks.

Why: on a GPU a decode step is launch-bound, and torch's eager ops launch one kernel per op, each
reading and writing the whole [T, hidden] tensor. Per decoder layer in bfloat16 (counting what the
torch path in layer_ops.py and the attention call's cache write launch; GEMMs and attention stay):

    op                     torch path                                         here
    add + RMSNorm (x2)     add, cast, pow, mean, add, rsqrt, mul, cast, mul: 9  1
    RoPE                   2 gathers, 2 casts, 4 muls, sub, add, cat, copy: 12 1, with the
    K/V cache write        slot // BS, slot % BS, 2 index_puts: 4              cache write
    SiLU x up              cast, cast, silu, mul, cast: 5                     1

about 39 kernels a layer become 4, and each reads and writes its rows once instead of once per op
(float32 skips the casts: ~33).

Layouts (T rows; rows may lie apart: row strides are passed, a row's values are dense):

    add_rms_norm_  residual [T, N] += delta [T, N]; out [T, N] = rmsnorm(residual) * weight [N]
    silu_mul       gate_up [T, 2I] (gate columns, then up) -> out [T, I]
    rope_          x [T, >= heads * D], heads rotated in place (rotate-half);
                   table [P, D] float32: cos in columns 0 .. D/2 - 1, sin in D/2 .. D - 1;
                   with a KVWrite, x [T, (H + 2 KVH) * D] and the K/V heads also stored in the
                   caches [NB, KVH, BS, D] at slot_mapping [T] (attention/paged.py's layout)

Numerics are layer_ops.torch_*'s, in float32: the norm rounds the residual sum, the normalized
row and the weight product to the dtype, as transformers does in bfloat16; RoPE and SiLU x up round
once at the end. Every kernel is compiled with fp fusion off, so a * b + c rounds the product
first, as torch's eager ops do: RoPE gives the torch path's bits; the norm's sum of squares runs in
another order than torch's reduction, and SiLU's exp is Triton's (the hardware's exp2), so those
two can differ from it by an ulp in bf16 (tests/model_service/test_ms_triton_ops.py's bounds).

Batch invariance by construction: one program per row (per row and column tile for the
elementwise ones); block sizes and warp counts come from the hidden size, head count and head dim,
never from T, so a row computes the same alone or in a batch. CUDA graphs: a call allocates only
its output (torch.empty) and launches one kernel, with no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel does not bring Triton
    triton = None

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ELEMENTWISE_BLOCK = 1024  # SiLU x up columns per program
ROPE_ELEMENTS = 2048  # RoPE: about this many of a row's values per program (heads x head dim)
# Every launch's: products rounded before sums, as torch's eager ops (see the docstring).
COMPILE_OPTIONS = dict(enable_fp_fusion=False)


def unsupported_reason(x: torch.Tensor) -> str | None:
    """Why the kernels cannot run on x (the caller runs the torch path), or None."""
    if triton is None:
        return "triton is not installed"
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype}"
    return None


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _num_warps(block: int) -> int:
    """Warps for a program of `block` values: ~256 values a warp, 1 .. 16."""
    return min(16, max(1, block // 256))


def _check_rows(name: str, t: torch.Tensor, columns: int) -> None:
    if t.dim() != 2 or t.shape[1] < columns or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"{name}: expected [T, >= {columns}] with dense rows, got {tuple(t.shape)} strides "
            f"{t.stride()}"
        )


def add_rms_norm_(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual [T, N] += delta (in place; nothing when delta is None), then a new [T, N] tensor
    RMSNorm(residual) * weight, in the dtype torch's `weight * x` gives."""
    rows, hidden = residual.shape
    _check_rows("residual", residual, hidden)
    if delta is not None:
        _check_rows("delta", delta, hidden)
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [{hidden}], got {tuple(weight.shape)}")
    out_dtype = torch.promote_types(weight.dtype, residual.dtype)
    out = torch.empty((rows, hidden), dtype=out_dtype, device=residual.device)
    if rows == 0:
        return out
    block = _next_power_of_2(hidden)
    _add_rms_norm_kernel[(rows,)](
        residual, residual if delta is None else delta, weight, out,
        residual.stride(0), 0 if delta is None else delta.stride(0), hidden, 1.0 / hidden, eps,
        HAS_DELTA=delta is not None, BLOCK=block,
        num_warps=_num_warps(block), **COMPILE_OPTIONS,
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns, then up columns) -> silu(gate) * up, [T, I], in gate_up's dtype."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    _check_rows("gate_up", gate_up, 2 * width)
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or width == 0:
        return out
    block = min(ELEMENTWISE_BLOCK, _next_power_of_2(width))
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](
        gate_up, out, gate_up.stride(0), width,
        BLOCK=block, num_warps=_num_warps(block), **COMPILE_OPTIONS,
    )  # fmt: skip
    return out


class KVWrite(NamedTuple):
    """Where rope_ also writes this step's K and V rows: the layer's caches [NB, KVH, BS, D]
    (contiguous, x's dtype) at slot_mapping [T] (slot = block * BS + offset: attention/paged.py).
    x's rows then hold H query heads, KVH key heads (the last KVH of rope_'s num_heads) and KVH
    value heads after them."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_kv_heads: int


def rope_(
    x: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    num_heads: int,
    head_dim: int,
    kv: KVWrite | None = None,
) -> None:
    """Rotate-half RoPE in place on the first num_heads heads (head_dim each) of x's rows;
    positions [T] index the float32 table [P, head_dim] (cos half, then sin half). With `kv`, the
    same programs also store the rotated K heads and the V heads into the caches, which saves the
    attention call its scatter (two more kernels a layer) and a second read of K and V."""
    rows = x.shape[0]
    num_kv_heads = 0 if kv is None else kv.num_kv_heads
    _check_rows("x", x, (num_heads + num_kv_heads) * head_dim)
    if head_dim % 2 or table.dim() != 2 or table.shape[1] != head_dim or table.stride(1) != 1:
        raise ValueError(
            f"rope: head_dim {head_dim} must be even and the table [P, {head_dim}] with dense "
            f"rows, got {tuple(table.shape)}"
        )
    if positions.shape != (rows,):
        raise ValueError(f"rope: positions must be [{rows}], got {tuple(positions.shape)}")
    if kv is not None:
        _check_kv(kv, x, rows, head_dim)
    if rows == 0 or num_heads + num_kv_heads == 0:
        return
    half_pad = _next_power_of_2(head_dim // 2)
    all_heads = num_heads + num_kv_heads  # with kv: the V heads are copied, not rotated
    heads_per_program = min(_next_power_of_2(all_heads), max(1, ROPE_ELEMENTS // (2 * half_pad)))
    caches = (x, x, positions, 1) if kv is None else (kv.k_cache, kv.v_cache, kv.slot_mapping,
                                                       kv.k_cache.shape[2])  # fmt: skip
    _rope_kernel[(rows, triton.cdiv(all_heads, heads_per_program))](
        x, positions, table, *caches[:3], x.stride(0), table.stride(0), num_heads,
        num_kv_heads, caches[3],
        HALF=head_dim // 2, HALF_PAD=half_pad, HEADS=heads_per_program, WRITE_KV=kv is not None,
        num_warps=_num_warps(heads_per_program * half_pad), **COMPILE_OPTIONS,
    )  # fmt: skip


def _check_kv(kv: KVWrite, x: torch.Tensor, rows: int, head_dim: int) -> None:
    for name, cache in (("k_cache", kv.k_cache), ("v_cache", kv.v_cache)):
        if (
            cache.dim() != 4
            or cache.shape[1] != kv.num_kv_heads
            or cache.shape[3] != head_dim
            or cache.dtype != x.dtype
            or not cache.is_contiguous()
        ):
            raise ValueError(
                f"rope: {name} must be a contiguous [NB, {kv.num_kv_heads}, BS, {head_dim}] of "
                f"{x.dtype}, got {tuple(cache.shape)} {cache.dtype}"
            )
    if kv.slot_mapping.shape != (rows,):
        raise ValueError(f"rope: slot_mapping must be [{rows}], got {tuple(kv.slot_mapping.shape)}")


# Defined only where Triton is (a CPU-only install imports this module for unsupported_reason).
if triton is not None:

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """float32 x to dtype, rounded to nearest even. bfloat16 by hand: the compiled cast rounds
        so too, but Triton's interpreter truncates, and the CPU tests must check the bits a GPU
        gives (NaNs kept as they are: the carry would turn some into infinities)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        return x.to(dtype)

    @triton.jit
    def _add_rms_norm_kernel(
        residual_ptr, delta_ptr, weight_ptr, out_ptr,
        residual_stride, delta_stride, hidden, inv_hidden, eps,
        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < hidden
        residual_row = residual_ptr + row * residual_stride + cols
        x = tl.load(residual_row, mask=live, other=0.0)
        if HAS_DELTA:
            delta = tl.load(delta_ptr + row * delta_stride + cols, mask=live, other=0.0)
            # Rounded to the dtype as torch's residual.add_ rounds it: the stored residual and the
            # row normed are the same values.
            x = _round(x.to(tl.float32) + delta.to(tl.float32), residual_ptr.dtype.element_ty)
            tl.store(residual_row, x, mask=live)
        x = x.to(tl.float32)
        # times 1 / N, as torch's CUDA mean finishes (its CPU one divides: an ulp apart at most).
        mean_square = tl.sum(x * x, axis=0) * inv_hidden
        # rsqrt as torch's: 1 / sqrt rounds twice and would differ in the last bit more often.
        normed = x * tl.rsqrt(mean_square + eps)
        # transformers rounds the normed row to the activations' dtype before the weight product.
        normed = _round(normed, residual_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, _round(weight * normed, out_ptr.dtype.element_ty),
                 mask=live)  # fmt: skip

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, row_stride, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < width
        gate = tl.load(gate_up_ptr + row * row_stride + cols, mask=live, other=0.0)
        up = tl.load(gate_up_ptr + row * row_stride + width + cols, mask=live, other=0.0)
        gate, up = gate.to(tl.float32), up.to(tl.float32)
        # div_rn: Triton's `/` is an approximate division; torch's divides exactly rounded.
        silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
        out = _round(silu * up, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * width + cols, out, mask=live)

    @triton.jit
    def _rope_kernel(
        x_ptr, positions_ptr, table_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        row_stride, table_stride, num_heads, num_kv_heads, block_size,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS: tl.constexpr, WRITE_KV: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        i = tl.arange(0, HALF_PAD)
        live_i = i < HALF
        rotated = (head < num_heads)[:, None] & live_i[None, :]
        live = (head < num_heads + num_kv_heads)[:, None] & live_i[None, :]
        position = tl.load(positions_ptr + row).to(tl.int64)
        cos = tl.load(table_ptr + position * table_stride + i, mask=live_i, other=0.0)[None, :]
        sin = tl.load(table_ptr + position * table_stride + HALF + i, mask=live_i, other=0.0)
        sin = sin[None, :]
        first = x_ptr + row * row_stride + head[:, None] * (2 * HALF) + i[None, :]
        x1 = tl.load(first, mask=live, other=0.0)
        x2 = tl.load(first + HALF, mask=live, other=0.0)
        out_type = x_ptr.dtype.element_ty
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        out1 = _round(a * cos - b * sin, out_type)
        out2 = _round(b * cos + a * sin, out_type)
        tl.store(first, out1, mask=rotated)
        tl.store(first + HALF, out2, mask=rotated)
        if WRITE_KV:
            _write_kv(k_cache_ptr, v_cache_ptr, slot_ptr, row, head, i, live_i,
                      tl.where(rotated, out1, x1), tl.where(rotated, out2, x2),
                      num_heads, num_kv_heads, block_size, HALF)  # fmt: skip

    @triton.jit
    def _write_kv(
        k_cache_ptr, v_cache_ptr, slot_ptr, row, head, i, live_i, first_half, second_half,
        num_heads, num_kv_heads, block_size, HALF: tl.constexpr,
    ):  # fmt: skip
        """Heads num_heads - KVH .. num_heads - 1 (rotated K) and the KVH after them (V) of one
        row into the caches: cache[slot // BS, kv head, slot % BS, :]."""
        kv_head = head - (num_heads - num_kv_heads)  # K: 0 .. KVH - 1, V: KVH .. 2 KVH - 1
        is_k = ((kv_head >= 0) & (kv_head < num_kv_heads))[:, None] & live_i[None, :]
        is_v = ((kv_head >= num_kv_heads) & (kv_head < 2 * num_kv_heads))[:, None]
        is_v = is_v & live_i[None, :]
        slot = tl.load(slot_ptr + row).to(tl.int64)
        cache_head = tl.where(kv_head < num_kv_heads, kv_head, kv_head - num_kv_heads)
        cache_row = (slot // block_size * num_kv_heads + cache_head) * block_size
        offsets = (cache_row + slot % block_size)[:, None] * (2 * HALF) + i[None, :]
        tl.store(k_cache_ptr + offsets, first_half, mask=is_k)
        tl.store(k_cache_ptr + offsets + HALF, second_half, mask=is_k)
        tl.store(v_cache_ptr + offsets, first_half, mask=is_v)
        tl.store(v_cache_ptr + offsets + HALF, second_half, mask=is_v)
